"""The rest of the T5 family against transformers' models from tiny random configs:
T5EncoderModel, MT5EncoderModel and UMT5EncoderModel (attnlab's encoder with the relative
position bias: hidden states with padding, gradients, export and import back), mT5's and
UMT5's (a bias table in every layer) encoder–decoders (logits, loss and gradients, export,
cached greedy decoding), and the published mT5 sizes. Shapes: b batch, s source length,
t target length."""

from __future__ import annotations

import json

import pytest
import torch
from hf_cases import transformers
from oracle import randomize_weights

from attnlab.analysis import count_parameters
from attnlab.config import ConfigError
from attnlab.interop import HFCheckpointError, config_from_hf, load_hf, save_hf
from attnlab.models import build_model
from attnlab.models.encoder import EncoderConfig, EncoderModel
from attnlab.presets import get_preset

V, PAD, EOS = 64, 0, 1
TOL = 1e-5  # float32 hidden states and logits of a few units

# name -> (config class, encoder-only class, encoder–decoder class, settings)
MODELS = {
    "t5": ("T5Config", "T5EncoderModel", "T5ForConditionalGeneration", {}),
    "t5-v1.1": (
        "T5Config",
        "T5EncoderModel",
        "T5ForConditionalGeneration",
        {"feed_forward_proj": "gated-gelu"},
    ),
    "mt5": ("MT5Config", "MT5EncoderModel", "MT5ForConditionalGeneration", {}),
    "umt5": ("UMT5Config", "UMT5EncoderModel", "UMT5ForConditionalGeneration", {}),
}
# what export writes: UMT5's tables in every layer need its own classes; the others are T5's
EXPORTED = {"umt5": ("umt5", "UMT5")}


def _exported(name: str) -> tuple[str, str]:
    """(model_type, class prefix) export writes for the model ``name``."""
    return EXPORTED.get(name, ("t5", "T5"))


def _tables(ref_stack, ours: str) -> dict:
    """attnlab name -> transformers' relative position bias table(s) of one stack: the first
    block's (T5, mT5), or every block's (UMT5)."""
    tables = {
        i: block.layer[0].SelfAttention.relative_attention_bias
        for i, block in enumerate(ref_stack.block)
        if hasattr(block.layer[0].SelfAttention, "relative_attention_bias")
    }
    if len(tables) == 1:
        return {f"{ours}.table.weight": tables[0].weight}
    return {f"{ours}.tables.{i}.weight": table.weight for i, table in tables.items()}


def _config(name: str, **kw):
    config_class, _, _, settings = MODELS[name]
    base = dict(
        vocab_size=V,
        d_model=32,
        d_kv=6,  # 4 heads of 6: inner width 24 != d_model
        d_ff=48,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,  # exact below 2 (encoder) / 4 (decoder)
        relative_attention_max_distance=12,  # sequences here run past it
        dropout_rate=0.0,
        pad_token_id=PAD,
        eos_token_id=EOS,
        decoder_start_token_id=PAD,
        attn_implementation="eager",
    )
    return getattr(transformers, config_class)(**{**base, **settings, **kw})


def _reference(name: str, cls: int, seed: int = 0, head: bool = False, emb: float = 6.0, **kw):
    """transformers' model (``cls`` 1: encoder alone, 2: encoder–decoder) with every weight
    far from its init, normal with std 0.15, the embedding ``emb`` times that; ``head``: an
    untied head of its own (transformers 5 ties a fresh model's head whatever the config
    says)."""
    if head:  # as the released untied checkpoints' config.json says (no rescale)
        kw.setdefault("tie_word_embeddings", False)
    torch.manual_seed(seed)
    ref = getattr(transformers, MODELS[name][cls])(_config(name, **kw)).eval()
    if head:
        ref.lm_head.weight = torch.nn.Parameter(torch.empty(V, 32))
    randomize_weights(ref, seed, std=0.15, norms=(0.5, 1.5))
    with torch.no_grad():
        ref.shared.weight.mul_(emb)
    return ref


def _batch(s: int = 20, t: int = 18):
    """Row 0 right-padded, row 1 left-padded (T5's positions are the same either way)."""
    g = torch.Generator().manual_seed(1)
    src = torch.randint(2, V, (2, s), generator=g)
    mask = torch.ones(2, s, dtype=torch.long)
    src[0, s - 6 :], mask[0, s - 6 :] = PAD, 0
    src[1, :4], mask[1, :4] = PAD, 0
    tgt = torch.cat((torch.full((2, 1), PAD), torch.randint(2, V, (2, t - 1), generator=g)), 1)
    return src, mask, tgt


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# --------------------------------------------------------------------------- the encoder


@pytest.fixture(scope="module", params=list(MODELS))
def encoder(request, tmp_path_factory):
    ref = _reference(request.param, 1)
    path = tmp_path_factory.mktemp(f"{request.param}-encoder")
    ref.save_pretrained(path)
    return request.param, ref, path


def test_encoder_hidden_states_match_transformers_with_padding(encoder):
    name, ref, path = encoder
    model = load_hf(path)
    assert isinstance(model, EncoderModel) and model.cfg.head == "none"
    assert model.cfg.ffn.kind == ("mlp" if name == "t5" else "glu")
    src, mask, _ = _batch()
    with torch.no_grad():
        theirs = ref(input_ids=src, attention_mask=mask).last_hidden_state
        ours = model(src, attention_mask=mask).logits  # head none: the hidden states
        unpadded = model.encode(src[:1, :14])  # row 0 without its padding
    assert theirs.abs().max() > 1.0
    assert _max_diff(ours, theirs) <= TOL
    assert _max_diff(unpadded, ours[:1, :14]) <= TOL  # padding changes no real token


def test_encoder_gradients_match_transformers(encoder):
    name, ref, path = encoder
    model = load_hf(path)
    src, mask, _ = _batch()
    weight = torch.randn(2, 20, 32, generator=torch.Generator().manual_seed(4))
    ref.zero_grad()
    (ref(input_ids=src, attention_mask=mask).last_hidden_state * weight).sum().backward()
    (model(src, attention_mask=mask).logits * weight).sum().backward()
    block = ref.encoder.block
    grads = {
        "tok_emb.weight": ref.shared.weight.grad,
        "blocks.1.attn.qkv.weight": torch.cat(
            [getattr(block[1].layer[0].SelfAttention, p).weight.grad for p in "qkv"]
        ),
        "blocks.0.ffn.down.weight": block[0].layer[1].DenseReluDense.wo.weight.grad,
        "norm.weight": ref.encoder.final_layer_norm.weight.grad,
    }
    tables = _tables(ref.encoder, "pos_bias")
    assert len(tables) == (2 if name == "umt5" else 1)
    grads |= {key: table.grad for key, table in tables.items()}
    params = dict(model.named_parameters())
    for key, expected in grads.items():
        assert _max_diff(params[key].grad, expected) <= 1e-5 * expected.abs().max(), key


def test_encoder_export_loads_in_transformers_and_imports_back_identically(encoder, tmp_path):
    name, ref, path = encoder
    model = load_hf(path)
    save_hf(model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    model_type, prefix = _exported(name)
    assert (hf["model_type"], hf["architectures"]) == (model_type, [f"{prefix}EncoderModel"])
    back = getattr(transformers, f"{prefix}EncoderModel").from_pretrained(tmp_path).eval()
    assert back.state_dict().keys() == ref.state_dict().keys()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in ref.state_dict().items())
    src, mask, _ = _batch()
    with torch.no_grad():
        expected = ref(input_ids=src, attention_mask=mask).last_hidden_state
        again = back(input_ids=src, attention_mask=mask).last_hidden_state
    assert _max_diff(again, expected) <= TOL  # (its default attention: sdpa, not eager)
    imported = load_hf(tmp_path)
    assert imported.cfg == model.cfg
    ours, theirs = model.state_dict(), imported.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_encoder_of_a_whole_checkpoint_is_read_as_transformers_reads_it(tmp_path):
    """T5EncoderModel.from_pretrained of an encoder–decoder's folder ignores its decoder and
    head; so does import, given architectures T5EncoderModel."""
    ref = _reference("t5-v1.1", 2, head=True)
    ref.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["T5EncoderModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    theirs = transformers.T5EncoderModel.from_pretrained(tmp_path, attn_implementation="eager")
    model = load_hf(tmp_path)
    src, mask, _ = _batch()
    with torch.no_grad():
        expected = theirs.eval()(input_ids=src, attention_mask=mask).last_hidden_state
        assert _max_diff(model(src, attention_mask=mask).logits, expected) <= TOL


def _encoder_preset() -> EncoderConfig:
    """t5-tiny's encoder alone, as T5EncoderModel's import reads it."""
    t5 = get_preset("t5-tiny")
    return EncoderConfig(vocab_size=t5.vocab_size, max_seq_len=t5.max_seq_len,
                         d_model=t5.d_model, n_layers=t5.n_layers, attention=t5.attention,
                         position=t5.position, ffn=t5.ffn, norm=t5.norm, dropout=t5.dropout,
                         type_vocab_size=0, embedding_norm=False, head="none")  # fmt: skip


@pytest.mark.parametrize(
    "changes, needs",
    [
        ({"head": "mlm"}, "head 'none'"),
        ({"type_vocab_size": 2}, "no token types"),
        ({"embedding_norm": True}, "no embedding norm"),
        ({"attention.qkv_bias": True}, "attention without biases"),
        ({"norm.kind": "layernorm"}, "pre-norm RMSNorm"),
    ],
)
def test_encoder_export_refuses_what_t5_encoder_cannot_hold(changes, needs, tmp_path):
    cfg = _encoder_preset().override(changes)
    with pytest.raises(HFCheckpointError, match=f"T5's encoder .*{needs}"):
        save_hf(build_model(cfg), tmp_path)


def test_relative_bias_encoder_needs_multi_head_attention():
    _encoder_preset().validate()
    mla = {"attention.kind": "mla", "attention.kv_lora_rank": 8, "attention.scale": None}
    with pytest.raises(ConfigError, match="relative_bias encoders need attention.kind 'mha'"):
        _encoder_preset().override(mla).validate()


# --------------------------------------------------------------------------- mT5


@pytest.fixture(scope="module", params=["mt5", "umt5"])
def mt5(request, tmp_path_factory):
    ref = _reference(request.param, 2, num_decoder_layers=3, head=True)
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    return request.param, ref, path


def test_mt5_logits_loss_and_gradients_match_transformers(mt5):
    name, ref, path = mt5
    model = load_hf(path)
    assert model.cfg.position.relative_bias_per_layer == (name == "umt5")
    cfg = model.cfg
    assert not cfg.tie_embeddings and not cfg.scale_decoder_output  # the stored head
    assert (cfg.ffn.kind, cfg.ffn.activation, cfg.decoder_layers) == ("glu", "gelu_tanh", 3)
    src, mask, tgt = _batch()
    with torch.no_grad():
        theirs = ref(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        ours = model(src, tgt, src_mask=mask).logits
    assert theirs.abs().max() > 1.0
    assert _max_diff(ours, theirs) <= TOL
    labels = torch.randint(2, V, (2, 9), generator=torch.Generator().manual_seed(5))
    labels[0, 6:] = -100  # a shorter target: ignored positions
    shifted = labels[:, :-1].masked_fill(labels[:, :-1] == -100, PAD)
    tgt = torch.cat((torch.full((2, 1), PAD), shifted), 1)
    ref.zero_grad()
    loss = ref(input_ids=src, attention_mask=mask, labels=labels).loss
    loss.backward()
    ours = model(src, tgt, src_mask=mask, targets=labels).loss
    ours.backward()
    assert abs(ours.item() - loss.item()) <= TOL
    params = dict(model.named_parameters())
    cross = ref.decoder.block[2].layer[1].EncDecAttention
    grads = {
        "src_emb.weight": ref.shared.weight.grad,
        "lm_head.weight": ref.lm_head.weight.grad,
        "decoder.2.cross_attn.q.weight": cross.q.weight.grad,
    }
    for stack, ours in ((ref.encoder, "src_pos_bias"), (ref.decoder, "tgt_pos_bias")):
        grads |= {key: table.grad for key, table in _tables(stack, ours).items()}
    assert len(grads) == (3 + 2 + 3 if name == "umt5" else 3 + 2)
    for key, expected in grads.items():
        assert _max_diff(params[key].grad, expected) <= 1e-5 * expected.abs().max(), key


def test_mt5_exports_and_imports_back_identically(mt5, tmp_path):
    """mT5's configs are T5 v1.1's: export writes t5, which transformers' T5 reads with the
    same logits (and MT5ForConditionalGeneration too); UMT5's (a table in every layer) are
    written as umt5."""
    name, ref, path = mt5
    model = load_hf(path)
    save_hf(model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    model_type, prefix = _exported(name)
    assert (hf["model_type"], hf["feed_forward_proj"]) == (model_type, "gated-gelu")
    classes = [f"{prefix}ForConditionalGeneration", MODELS[name][2]]
    src, mask, tgt = _batch()
    with torch.no_grad():
        expected = ref(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        for cls in dict.fromkeys(classes):
            back = getattr(transformers, cls).from_pretrained(tmp_path).eval()
            again = back(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
            assert _max_diff(again, expected) <= TOL, cls
    imported = load_hf(tmp_path)
    assert imported.cfg == model.cfg
    ours, theirs = model.state_dict(), imported.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("name", ["mt5", "umt5"])
def test_mt5_greedy_tokens_equal_transformers_generate_with_the_cache(name, tmp_path):
    """Each layer's bias (UMT5: its own table) at the query's true position under the cache."""
    ref = _reference(name, 2, seed=3, head=True)  # equal depths: transformers 5's cache
    ref.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    src, mask, _ = _batch()
    n = 16  # past the largest bucket's distance (12)
    out = ref.generate(input_ids=src, attention_mask=mask, max_new_tokens=n, do_sample=False)
    theirs = [seq[1:] for seq in out.tolist()]  # without the decoder start token
    theirs = [seq[: seq.index(EOS)] if EOS in seq else seq for seq in theirs]
    ours = model.generate(src, n, src_mask=mask)
    assert ours == theirs
    assert len({token for row in ours for token in row}) > 3  # not one token repeated
    assert model.generate(src, n, src_mask=mask, use_cache=False) == ours


def test_tied_mt5_reads_its_output_unscaled(tmp_path):
    """A fresh mT5 of transformers 5 ties its head (no lm_head stored) and, unlike T5 v1.0,
    never rescales the decoder's output, whatever config.json says."""
    ref = _reference("mt5", 2, seed=2, emb=2.0)  # tied and unscaled: logits of tens else
    ref.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    config["scale_decoder_outputs"] = True  # read by T5's class only
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_hf(tmp_path)
    assert model.cfg.tie_embeddings and not model.cfg.scale_decoder_output
    src, mask, tgt = _batch()
    with torch.no_grad():
        theirs = ref(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        ours = model(src, tgt, src_mask=mask).logits
    # 1e-5 relative: logits up to ~6, where float32 rounds either model ~1e-5 from float64
    assert _max_diff(ours, theirs) <= TOL * theirs.abs().max()


def test_tied_umt5_reads_the_rescale_as_t5(tmp_path):
    """UMT5's class, unlike mT5's, rescales a tied head's input by d^-1/2 (T5 v1.0's)."""
    ref = _reference("umt5", 2, seed=2)
    ref.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    assert model.cfg.tie_embeddings and model.cfg.scale_decoder_output
    src, mask, tgt = _batch()
    with torch.no_grad():
        theirs = ref(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        assert _max_diff(model(src, tgt, src_mask=mask).logits, theirs) <= TOL


def test_relative_bias_per_layer_needs_the_relative_bias():
    cfg = get_preset("t5-tiny").override({"position.relative_bias_per_layer": True})
    assert len(build_model(cfg).src_pos_bias.tables) == cfg.n_layers
    with pytest.raises(ConfigError, match="relative_bias_per_layer: needs position.kind"):
        get_preset("vaswani-tiny").override({"position.relative_bias_per_layer": True})


@pytest.mark.parametrize("name, published", [("mt5-small", 300), ("mt5-base", 580)])
def test_mt5_presets_count_transformers_parameters(name, published):
    """Each preset is what import reads from its config.json, and has the parameters of
    transformers' mT5 of that config (built on the meta device); the paper's sizes
    (millions, rounded there) agree."""
    preset = get_preset(name)
    hf = dict(model_type="mt5", vocab_size=preset.vocab_size, d_model=preset.d_model,
              d_kv=preset.head_dim, d_ff=preset.ffn.hidden_dim, num_layers=preset.n_layers,
              num_heads=preset.n_heads, tie_word_embeddings=False, n_positions=512)  # fmt: skip
    assert config_from_hf(hf) == preset
    assert config_from_hf({**hf, "architectures": ["MT5ForConditionalGeneration"]}) == preset
    with torch.device("meta"):
        reference = transformers.MT5ForConditionalGeneration(transformers.MT5Config(**hf))
    n = reference.num_parameters() + preset.vocab_size * preset.d_model  # (its head: tied)
    assert count_parameters(preset)["total"] == n
    assert abs(n / 1e6 - published) / published < 0.01
