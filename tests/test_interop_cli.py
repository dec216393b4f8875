"""Every Hugging Face family through the CLI: a transformers model from a tiny random config,
saved with ``save_pretrained``, goes through ``attnlab import-hf`` (an attnlab checkpoint) and
``attnlab export-hf`` (a Hugging Face folder again); the imported checkpoint and the exported
folder, loaded by transformers, give the reference's logits within 1e-4. A missing or
mis-shaped tensor is an error naming it, for every family; ``generate`` and ``eval`` run on
an imported DeepSeek checkpoint.

Shapes: b batch, t length, V vocabulary size, c channels, H x W image size.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from hf_cases import NO_SPECIAL, transformers
from safetensors.torch import load, save_file

from attnlab.cli.main import main
from attnlab.interop import SUPPORTED_MODEL_TYPES, load_hf
from attnlab.tokenizers import train_tokenizer
from attnlab.training import load_checkpoint

TEXT = "the quick brown fox jumps over the lazy dog. THE END!\n"
TOKENIZER = train_tokenizer("char", [TEXT])
V = TOKENIZER.vocab_size
TOL = 1e-4
DEEPSEEK = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    max_position_embeddings=64,
    n_routed_experts=4,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    **NO_SPECIAL,
)
MIXTRAL = dict(  # a window shorter than the inputs; 4 experts of which 2
    vocab_size=V,
    hidden_size=32,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    sliding_window=6,
    num_local_experts=4,
    num_experts_per_tok=2,
    **NO_SPECIAL,
)
BERT = dict(
    vocab_size=V,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    max_position_embeddings=32,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def _text_ids(b: int, t: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"input_ids": torch.randint(0, V, (b, t), generator=g)}


def _seq2seq_ids() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "input_ids": torch.randint(3, V, (2, 7), generator=g),
        "decoder_input_ids": torch.randint(3, V, (2, 5), generator=g),
    }


def _images() -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(7))}


def _hf_logits(out) -> torch.Tensor:
    if hasattr(out, "start_logits"):  # question answering: (b, t, 2)
        return torch.stack((out.start_logits, out.end_logits), -1)
    return out.logits


def _ours(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    if "pixel_values" in inputs:
        return model(inputs["pixel_values"]).logits
    if "decoder_input_ids" in inputs:
        return model(inputs["input_ids"], inputs["decoder_input_ids"]).logits
    return model(inputs["input_ids"]).logits


# family -> (transformers class, its config, inputs)
FAMILIES = {
    "gpt2": (
        "GPT2LMHeadModel",
        lambda: transformers.GPT2Config(
            vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4, **NO_SPECIAL
        ),
        lambda: _text_ids(2, 12),
    ),
    "llama": (
        "LlamaForCausalLM",
        lambda: transformers.LlamaConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            **NO_SPECIAL,
        ),
        lambda: _text_ids(2, 12),
    ),
    "mixtral": (
        "MixtralForCausalLM",
        lambda: transformers.MixtralConfig(**MIXTRAL),
        lambda: _text_ids(2, 12),
    ),
    "gpt_oss": (
        "GptOssForCausalLM",
        lambda: transformers.GptOssConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=24,
            head_dim=12,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,  # layers sliding, full (transformers' default)
            max_position_embeddings=64,
            swiglu_limit=2.0,
            **NO_SPECIAL,
        ),
        lambda: _text_ids(2, 12),
    ),
    # norms on the sublayers' outputs, QK-norm over whole projections, GQA
    "olmo2": (
        "Olmo2ForCausalLM",
        lambda: transformers.Olmo2Config(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            **NO_SPECIAL,
        ),
        lambda: _text_ids(2, 12),
    ),
    "gemma": (
        "GemmaForCausalLM",
        lambda: transformers.GemmaConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=48,
            head_dim=8,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=64,
            **NO_SPECIAL,
        ),
        lambda: _text_ids(2, 12),
    ),
    # soft caps low enough to bend the scores and logits (transformers' Gemma 2 runs its
    # eager attention: it has no sdpa path)
    "gemma2": (
        "Gemma2ForCausalLM",
        lambda: transformers.Gemma2Config(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=48,
            head_dim=8,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            query_pre_attn_scalar=12,
            sliding_window=5,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=2.0,
            max_position_embeddings=64,
            **NO_SPECIAL,
        ),
        lambda: _text_ids(2, 12),
    ),
    "gemma3_text": (
        "Gemma3ForCausalLM",
        lambda: transformers.Gemma3TextConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=48,
            head_dim=8,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            query_pre_attn_scalar=12,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            max_position_embeddings=64,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
            **NO_SPECIAL,
        ),
        lambda: _text_ids(2, 12),
    ),
    # LongRoPE with an original context of 8: the 12 tokens run past it (the long factors)
    "phi3": (
        "Phi3ForCausalLM",
        lambda: transformers.Phi3Config(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            original_max_position_embeddings=8,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 100.0,
                "short_factor": [1.0, 1.1, 1.3, 1.6],
                "long_factor": [1.0, 2.0, 3.0, 4.0],
            },
            **NO_SPECIAL,
        ),
        lambda: _text_ids(2, 12),
    ),
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        lambda: transformers.DeepseekV3Config(**DEEPSEEK, n_group=2, topk_group=1),
        lambda: _text_ids(2, 12),
    ),
    "deepseek_v32": (
        "DeepseekV32ForCausalLM",
        lambda: transformers.DeepseekV32Config(
            **DEEPSEEK, n_group=2, topk_group=1, index_topk=5, index_n_heads=4, index_head_dim=8
        ),
        lambda: _text_ids(2, 12),  # longer than index_topk: the indexer selects
    ),
    "deepseek_v2": (
        "DeepseekV2ForCausalLM",
        lambda: transformers.DeepseekV2Config(**{**DEEPSEEK, "q_lora_rank": None}),
        lambda: _text_ids(2, 12),
    ),
    "bert_mlm": (
        "BertForMaskedLM",
        lambda: transformers.BertConfig(**BERT),
        lambda: _text_ids(2, 10),
    ),
    "bert_sequence": (
        "BertForSequenceClassification",
        lambda: transformers.BertConfig(**BERT, num_labels=3),
        lambda: _text_ids(2, 10),
    ),
    "bert_token": (
        "BertForTokenClassification",
        lambda: transformers.BertConfig(**BERT, num_labels=4),
        lambda: _text_ids(2, 10),
    ),
    "bert_qa": (
        "BertForQuestionAnswering",
        lambda: transformers.BertConfig(**BERT),
        lambda: _text_ids(2, 10),
    ),
    "marian": (
        "MarianMTModel",
        lambda: transformers.MarianConfig(
            vocab_size=V,
            decoder_vocab_size=V,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=48,
            decoder_ffn_dim=48,
            max_position_embeddings=32,
            pad_token_id=1,
            decoder_start_token_id=1,
            eos_token_id=2,
            forced_eos_token_id=None,
            scale_embedding=True,
        ),
        _seq2seq_ids,
    ),
    "vit": (
        "ViTForImageClassification",
        lambda: transformers.ViTConfig(
            image_size=8,
            patch_size=4,
            num_channels=3,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=48,
            num_labels=5,
        ),
        _images,
    ),
}


def _reference(family: str, path):
    """A randomised transformers model of ``family``, saved to ``path`` (with a tokenizer
    for the decoders and BERT)."""
    cls, config, _ = FAMILIES[family]
    if not hasattr(transformers, cls):  # DeepSeek-V3.2 is in recent transformers only
        pytest.skip(f"this transformers has no {cls}")
    torch.manual_seed(0)
    hf_config = config()
    hf_config._attn_implementation = "eager"
    ref = getattr(transformers, cls)(hf_config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # far from the init, so that a wrong mapping shows
        for name, p in ref.named_parameters():
            if "embed_positions" in name:  # Marian's fixed sinusoids
                continue
            norm = any(k in name.lower() for k in ("norm", "ln_"))
            if norm and name.endswith("weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    ref.save_pretrained(path)
    if family != "vit":
        TOKENIZER.save(path / "tokenizer.json")
    return ref


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "cache"))


def _cli(*argv: str) -> None:
    assert main(list(argv)) == 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cli_import_export_round_trip(family, tmp_path, cache, capsys):
    ref = _reference(family, tmp_path / "hf")
    inputs = FAMILIES[family][2]()
    with torch.no_grad():
        expected = _hf_logits(ref(**inputs))
    assert expected.abs().max() > 0.5

    _cli("import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    ckpt = load_checkpoint(tmp_path / "ckpt")
    assert (ckpt.tokenizer is None) == (family == "vit")
    with torch.no_grad():
        torch.testing.assert_close(_ours(ckpt.model, inputs), expected, atol=TOL, rtol=TOL)

    _cli("export-hf", str(tmp_path / "ckpt"), str(tmp_path / "out"))
    hf_config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf_config["architectures"] == [FAMILIES[family][0]]
    back = getattr(transformers, FAMILIES[family][0]).from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(_hf_logits(back(**inputs)), expected, atol=TOL, rtol=TOL)
    assert "exported" in capsys.readouterr().out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_missing_or_misshaped_tensor_is_named(family, tmp_path):
    path = tmp_path / "hf"
    _reference(family, path)
    # in memory, not mapped from the file (safetensors < 0.8 maps it): the file is rewritten
    # below, shorter, and reading a mapped tensor past its new end is a bus error
    tensors = load((path / "model.safetensors").read_bytes())
    # a weight of the second layer (index 1), whatever the family calls its layers
    name = min(k for k in tensors if ".1." in k and k.endswith("weight") and tensors[k].dim() == 2)
    save_file({k: v for k, v in tensors.items() if k != name}, path / "model.safetensors")
    with pytest.raises(ValueError, match=f"missing tensors: {name}"):
        load_hf(path)
    save_file({**tensors, name: tensors[name][:-1]}, path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{name} has shape"):
        load_hf(path)


def test_unsupported_model_type_is_one_error_listing_the_supported(tmp_path, capsys):
    path = tmp_path / "hf"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "codegen"}))
    assert main(["import-hf", str(path), str(tmp_path / "ckpt")]) != 0
    err = capsys.readouterr().err
    assert "model_type 'codegen' is not supported" in err
    assert ", ".join(SUPPORTED_MODEL_TYPES) in err
    assert set(SUPPORTED_MODEL_TYPES) >= {"deepseek_v2", "deepseek_v3", "bert", "marian", "vit"}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"n_layer": "two"}, "n_layers: expected an integer, got 'two'"),
        ({"model_type": ["gpt2"]}, "model_type must be a string"),
        ({"architectures": "GPT2LMHeadModel"}, "architectures must be a list of names"),
    ],
)
def test_malformed_hf_config_value_is_one_error(change, message, tmp_path, capsys):
    """A config.json value of the wrong type is one error line, not a traceback (a string
    reached a comparison, a list a dict lookup)."""
    _reference("gpt2", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    for argv in (
        ["import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")],
        ["info", "--ckpt", str(tmp_path / "hf")],
    ):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("attnlab: error: ") and err.count("\n") == 1
        assert message in err
    assert not (tmp_path / "ckpt").exists()


def test_integral_float_in_hf_config_reads_as_an_integer(tmp_path, capsys):
    """``"n_embd": 16.0`` (some hub configs write integers as floats) is 16, as transformers
    reads it, not a float that failed in torch.empty."""
    ref = _reference("gpt2", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    floats = {k: float(config[k]) for k in ("n_embd", "n_layer", "n_head", "n_positions")}
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **floats}))
    _cli("import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    cfg = load_checkpoint(tmp_path / "ckpt").config.model
    assert (cfg.d_model, cfg.n_layers) == (ref.config.n_embd, ref.config.n_layer)
    assert type(cfg.d_model) is int and type(cfg.n_layers) is int


def test_generate_and_eval_on_imported_deepseek(tmp_path, cache, capsys):
    ref = _reference("deepseek_v3", tmp_path / "hf")
    _cli("import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    capsys.readouterr()

    prompt = "the "
    ids = torch.tensor([TOKENIZER.encode(prompt)])
    with torch.no_grad():
        greedy = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8)
    argv = ["--prompt", prompt, "--temperature", "0", "--max-new-tokens", "8"]
    _cli("generate", "--ckpt", str(tmp_path / "ckpt"), *argv)
    out = capsys.readouterr().out
    assert out == prompt + TOKENIZER.decode(greedy[0, ids.shape[1] :].tolist()) + "\n"

    data = tmp_path / "text.txt"
    data.write_text(TEXT * 4)
    block = 16
    _cli("eval", "--ckpt", str(tmp_path / "ckpt"), "--data", str(data), "--block-size", "16")
    capsys.readouterr()
    args = ["--block-size", str(block), "--batch-size", "2", "--max-batches", "1", "--json"]
    _cli("eval", "--ckpt", str(tmp_path / "ckpt"), "--data", str(data), *args)
    report = json.loads(capsys.readouterr().out)
    tokens = TOKENIZER.encode(TEXT * 4)
    with torch.no_grad():  # the reference's loss on the first two blocks
        x = torch.tensor([tokens[j * block : (j + 1) * block] for j in range(2)])
        y = torch.tensor([tokens[j * block + 1 : (j + 1) * block + 1] for j in range(2)])
        loss = F.cross_entropy(ref(x).logits.flatten(0, 1), y.flatten())
    assert report["tokens"] == 2 * block
    assert report["loss"] == pytest.approx(loss.item(), rel=1e-4)


def test_generate_on_imported_mixtral(tmp_path, cache, capsys):
    """``import-hf`` then ``generate``: greedy tokens are transformers' Mixtral's, past its
    sliding window (6) and with experts routed per token."""
    ref = _reference("mixtral", tmp_path / "hf")
    _cli("import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    capsys.readouterr()
    prompt = "the quick "
    ids = torch.tensor([TOKENIZER.encode(prompt)])
    with torch.no_grad():
        greedy = ref.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
        )
    argv = ["--prompt", prompt, "--temperature", "0", "--max-new-tokens", "12"]
    _cli("generate", "--ckpt", str(tmp_path / "ckpt"), *argv)
    assert (
        capsys.readouterr().out
        == prompt + TOKENIZER.decode(greedy[0, ids.shape[1] :].tolist()) + "\n"
    )


def test_generate_on_imported_gpt_oss(tmp_path, cache, capsys):
    """``import-hf`` of a GPT-OSS folder, then ``generate``: transformers' greedy tokens,
    the prompt and continuation longer than the sliding window."""
    ref = _reference("gpt_oss", tmp_path / "hf")
    _cli("import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    capsys.readouterr()
    prompt = "the quick "
    ids = torch.tensor([TOKENIZER.encode(prompt)])
    assert ids.shape[1] > ref.config.sliding_window
    with torch.no_grad():
        greedy = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                              do_sample=False)  # fmt: skip
    argv = ["--prompt", prompt, "--temperature", "0", "--max-new-tokens", "10"]
    _cli("generate", "--ckpt", str(tmp_path / "ckpt"), *argv)
    continuation = TOKENIZER.decode(greedy[0, ids.shape[1] :].tolist())
    assert capsys.readouterr().out == prompt + continuation + "\n"


def _llama_tokenizer(path) -> None:
    """A LLaMA-style tokenizer.json with the tokenizer_config.json transformers reads it
    with."""
    from oracle import llama_style_tokenizer

    transformers.PreTrainedTokenizerFast(
        tokenizer_object=llama_style_tokenizer(TEXT * 4, vocab_size=64),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    ).save_pretrained(path)


def test_generate_and_eval_read_text_as_the_imported_tokenizer_does(tmp_path, cache, capsys):
    """A LLaMA tokenizer puts <s> before a text: ``generate --prompt`` and ``eval --data``
    read the text so, as ``tokenizer(text)`` does in transformers (before, the prompt
    lacked <s>: another continuation than transformers' greedy one; and eval scored the
    text without it: loss 6.564 against 6.537 with <s> on a tiny random LLaMA)."""
    path = tmp_path / "hf"
    _llama_tokenizer(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    vocab = len(tokenizer)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    ref = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper than the init: the context decides the next token
        for p in ref.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    ref.save_pretrained(path)
    _cli("import-hf", str(path), str(tmp_path / "ckpt"))
    capsys.readouterr()

    prompt = "the quick"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids[0, 0].item() == 1  # <s>
    new = 12
    with torch.no_grad():
        greedy = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              do_sample=False, eos_token_id=None)  # fmt: skip
    want = tokenizer.decode(greedy[0].tolist())
    argv = ["--prompt", prompt, "--temperature", "0", "--max-new-tokens", str(new), "--ignore-eos"]
    _cli("generate", "--ckpt", str(tmp_path / "ckpt"), *argv)
    assert "<s> " + capsys.readouterr().out == want + "\n"

    data = tmp_path / "text.txt"
    data.write_text(TEXT * 2)
    tokens = tokenizer(TEXT * 2).input_ids  # <s> + the text
    block = 16
    args = ["--block-size", str(block), "--stride", str(block), "--json"]
    _cli("eval", "--ckpt", str(tmp_path / "ckpt"), "--data", str(data), *args)
    report = json.loads(capsys.readouterr().out)
    total = 0.0
    with torch.no_grad():  # every token after <s> scored once, in windows of 16
        for start in range(0, len(tokens) - 1, block):
            x = torch.tensor([tokens[start : start + block + 1]])
            total += F.cross_entropy(ref(x[:, :-1]).logits[0], x[0, 1:], reduction="sum").item()
    assert report["tokens"] == len(tokens) - 1
    assert report["loss"] == pytest.approx(total / (len(tokens) - 1), rel=1e-4)
