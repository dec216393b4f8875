"""Attention maps (attnlab.attention_maps, ``attnlab attention-map``): the recorded weights
equal softmax(q k^T / sqrt(d_h)) recomputed from the layer's own projections, and equal
transformers' ``output_attentions`` for BERT, Marian and ViT built from tiny random
configs; the CLI writes a PNG grid of the right size; bad input gives one clear error.

Shapes: b batch, L layers, h heads, t queries, s keys."""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402

from attnlab.attention_maps import (  # noqa: E402
    DPI,
    AttentionGrid,
    AttentionMapError,
    draw_attention,
    figure_inches,
    panel_rows,
    record_attention,
    save_png,
    stack_layers,
    token_label,
)
from attnlab.cli.main import main  # noqa: E402
from attnlab.config import AttentionConfig, ModelConfig, PositionConfig, RunConfig  # noqa: E402
from attnlab.models import build_model  # noqa: E402


def tiny_decoder(**attention) -> torch.nn.Module:
    cfg = ModelConfig(
        vocab_size=20,
        max_seq_len=12,
        d_model=32,
        n_layers=2,
        attention=AttentionConfig(n_heads=4, **attention),
        position=PositionConfig(kind="learned"),
    )
    model = build_model(cfg).eval()
    with torch.no_grad():  # larger weights than the init: weights far from uniform
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def test_weights_equal_softmax_recomputed_from_the_projections():
    model = tiny_decoder(backend="sdpa")  # a fused backend: recording must run eager
    idx = torch.randint(0, 20, (2, 9))
    inputs = {}  # each attention module's input x (b, t, d)
    hooks = [
        block.attn.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0]))
        for i, block in enumerate(model.blocks)
    ]
    with torch.no_grad():
        plain = model(idx).logits
        with record_attention(model) as maps:
            recorded = model(idx).logits
    for h in hooks:
        h.remove()
    torch.testing.assert_close(recorded, plain, atol=1e-5, rtol=1e-5)  # eager == sdpa
    assert sorted(maps) == ["blocks.0.attn", "blocks.1.attn"]
    for i, block in enumerate(model.blocks):
        x, attn = inputs[i], block.attn
        b, t, _ = x.shape
        d_h = attn.head_dim
        q, k, _ = (x @ attn.qkv.weight.T).split(attn.q_dim, dim=-1)  # (b, t, h d_h) each
        q = q.view(b, t, attn.n_heads, d_h).transpose(1, 2)  # (b, h, t, d_h)
        k = k.view(b, t, attn.n_heads, d_h).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d_h)  # (b, h, t, t)
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        want = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        got = maps[f"blocks.{i}.attn"]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.sum(-1), torch.ones(b, 4, t))  # rows sum to 1
        assert bool((got[..., future] == 0).all())  # nothing above the diagonal
    stacked = stack_layers(maps)
    assert list(stacked) == ["blocks.attn"] and stacked["blocks.attn"].shape == (2, 2, 4, 9, 9)


def test_linear_attention_has_no_map():
    model = tiny_decoder(kind="linear")
    with pytest.raises(AttentionMapError, match="no softmax"):
        with torch.no_grad(), record_attention(model):
            model(torch.randint(0, 20, (1, 5)))


def test_sink_logit_maps_leave_the_sinks_share_out():
    """With learned sink logits each row's weights over the keys sum to 1 minus the
    sink's share, sigmoid(sink_h - logsumexp(scores)), and the recorded map reproduces
    the layer's attention output."""
    model = tiny_decoder(sink_logits=True)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.sink_logit.normal_(std=2.0)
    attn = model.blocks[0].attn
    seen = {}
    hook = attn.register_forward_hook(lambda m, args, out: seen.update(x=args[0], y=out))
    idx = torch.randint(0, 20, (2, 6))
    with torch.no_grad(), record_attention(model) as maps:
        model(idx)
    hook.remove()
    w = stack_layers(maps)["blocks.attn"]  # (L, b, h, t, s)
    sums = w.sum(-1)
    assert bool((sums < 1).all()) and bool((sums > 0).all())
    assert bool((w[..., torch.ones(6, 6, dtype=torch.bool).triu(1)] == 0).all())
    with torch.no_grad():  # the layer's output from the recorded map: out(W V)
        v = attn.qkv(seen["x"])[..., attn.q_dim + attn.kv_dim :]
        v = v.view(2, 6, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
        v = v.repeat_interleave(attn.n_heads // attn.n_kv_heads, 1)
        y = attn.out((w[0] @ v).transpose(1, 2).reshape(2, 6, attn.q_dim))
    torch.testing.assert_close(y, seen["y"], atol=1e-5, rtol=1e-5)


def test_naive_mla_records_its_weights():
    model = tiny_decoder(kind="mla", mla_path="naive")
    with torch.no_grad(), record_attention(model) as maps:
        model(torch.randint(0, 20, (1, 6)))
    w = stack_layers(maps)["blocks.attn"]  # (L, b, h, t, s)
    torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))
    assert bool((w[..., torch.ones(6, 6, dtype=torch.bool).triu(1)] == 0).all())


def test_absorbed_mla_records_the_naive_paths_weights():
    # The absorbed path scores the latents instead of per-head keys: the same softmax.
    idx = torch.randint(0, 20, (2, 7))
    naive = tiny_decoder(kind="mla", mla_path="naive")
    absorbed = tiny_decoder(kind="mla", mla_path="absorbed")
    absorbed.load_state_dict(naive.state_dict())
    recorded = []
    for model in (naive, absorbed):
        with torch.no_grad(), record_attention(model) as maps:
            model(idx)
        recorded.append(stack_layers(maps)["blocks.attn"])
    torch.testing.assert_close(recorded[1], recorded[0], atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------- vs transformers


def _hf_model(family: str):
    transformers = pytest.importorskip("transformers")
    common = dict(attn_implementation="eager")
    if family == "bert":
        cfg = transformers.BertConfig(
            vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=48, max_position_embeddings=32, **common,
        )  # fmt: skip
        return transformers.BertForMaskedLM(cfg)
    if family == "marian":
        cfg = transformers.MarianConfig(
            vocab_size=43, decoder_vocab_size=43, d_model=32, encoder_layers=2,
            decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=64, pad_token_id=1,
            decoder_start_token_id=1, eos_token_id=2, forced_eos_token_id=None,
            scale_embedding=True, **common,
        )  # fmt: skip
        return transformers.MarianMTModel(cfg)
    cfg = transformers.ViTConfig(
        image_size=8, patch_size=2, num_channels=1, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=48, num_labels=3, **common,
    )  # fmt: skip
    return transformers.ViTForImageClassification(cfg)


@pytest.mark.parametrize("family", ["bert", "marian", "vit"])
def test_recorded_weights_equal_transformers_output_attentions(family, tmp_path):
    from attnlab.interop import load_hf

    ref = _hf_model(family).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():  # sharper attention than the 0.02 init
            if p.dim() > 1 and "embed_positions" not in name:  # Marian's are fixed sinusoids
                p.mul_(8.0)
    ref.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    g = torch.Generator().manual_seed(1)
    if family == "marian":
        src = torch.randint(3, 43, (2, 7), generator=g)
        tgt = torch.randint(3, 43, (2, 5), generator=g)
        theirs = ref(input_ids=src, decoder_input_ids=tgt, output_attentions=True)
        expected = {"encoder.attn": theirs.encoder_attentions,
                    "decoder.attn": theirs.decoder_attentions,
                    "decoder.cross_attn": theirs.cross_attentions}  # fmt: skip
        args = (src, tgt)
    elif family == "bert":
        idx = torch.randint(0, 40, (2, 9), generator=g)
        expected = {"blocks.attn": ref(idx, output_attentions=True).attentions}
        args = (idx,)
    else:
        images = torch.rand(2, 1, 8, 8, generator=g)
        expected = {"blocks.attn": ref(images, output_attentions=True).attentions}
        args = (images,)
    with torch.no_grad(), record_attention(model) as maps:
        model(*args)
    got = stack_layers(maps)
    assert set(got) == set(expected)
    for name, theirs in expected.items():
        torch.testing.assert_close(got[name], torch.stack(theirs).detach(), atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def decoder_ckpt(tmp_path_factory):
    from attnlab.tokenizers import train_tokenizer
    from attnlab.training.checkpoint import save_checkpoint

    tokenizer = train_tokenizer("char", ["hello world, attention maps"])
    model = tiny_decoder()
    model.cfg.vocab_size = 20
    assert tokenizer.vocab_size <= 20
    path = tmp_path_factory.mktemp("decoder")
    save_checkpoint(path, model, RunConfig(model=model.cfg), tokenizer)
    return path


def _png_size(path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as image:
        image.verify()  # a complete, valid PNG
    with Image.open(path) as image:
        assert image.format == "PNG"
        return image.size


def _expected_size(rows: int, cols: int) -> tuple[int, int]:
    w, h = figure_inches(rows, cols)
    return round(w * DPI), round(h * DPI)


def test_cli_draws_a_grid_of_layers_by_heads(decoder_ckpt, tmp_path, capsys):
    out = tmp_path / "map.png"
    assert main(["attention-map", "--ckpt", str(decoder_ckpt), "--text", "hello", "--out",
                 str(out)]) == 0  # fmt: skip
    assert "8 heatmaps" in capsys.readouterr().out  # 2 layers x 4 heads
    assert _png_size(out) == _expected_size(2, 4)
    some = tmp_path / "some.png"
    assert main(["attention-map", "--ckpt", str(decoder_ckpt), "--ids", "1,2,3", "--out",
                 str(some), "--layers", "1", "--heads", "0,2"]) == 0  # fmt: skip
    assert _png_size(some) == _expected_size(1, 2)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--text", "hello world " * 3], "exceed the model's max_seq_len=12"),
        (["--text", "xyz"], "not in the vocabulary"),
        (["--ids", "1,99"], "outside the model's vocabulary"),
        (["--text", "hello", "--heads", "4"], "--heads 4: the model has 4 heads"),
        (["--text", "hello", "--layers", "2"], "--layers 2: the model has 2 layers"),
        (["--text", "hello", "--image", "x.png"], "--image is for ViT checkpoints"),
        (["--text", "hello", "--invert"], "--invert is for ViT checkpoints"),
        ([], "give the input with --text"),
    ],
)
def test_cli_bad_input_is_one_clear_error(decoder_ckpt, tmp_path, capsys, extra, message):
    out = tmp_path / "map.png"
    assert main(["attention-map", "--ckpt", str(decoder_ckpt), "--out", str(out), *extra]) == 1
    err = capsys.readouterr().err
    assert err.startswith("attnlab: error:") and message in err and err.count("\n") == 1
    assert not out.exists()


def test_cli_out_that_is_a_folder_is_named_in_the_error(decoder_ckpt, tmp_path, capsys):
    out = tmp_path / "maps"
    out.mkdir()
    assert main(["attention-map", "--ckpt", str(decoder_ckpt), "--out", str(out), "--text",
                 "hello"]) == 1  # fmt: skip
    err = capsys.readouterr().err
    assert err == f"attnlab: error: --out {out}: is a folder; give a .png file name\n"
    assert list(out.iterdir()) == [] and sorted(tmp_path.iterdir()) == [out]


WRITTEN_AS = "(the map is written as a PNG)"


def test_cli_out_must_be_a_png_name(decoder_ckpt, tmp_path, capsys):
    """A PNG was written under any name given, over any file (a checkpoint's weights)."""
    weights = decoder_ckpt / "model.safetensors"
    before = weights.read_bytes()
    for out in (weights, tmp_path / "map.txt", tmp_path / "map"):
        argv = ["attention-map", "--ckpt", str(decoder_ckpt), "--out", str(out), "--text", "hi"]
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err == f"attnlab: error: --out {out}: give a .png file name {WRITTEN_AS}\n"
    assert weights.read_bytes() == before and sorted(tmp_path.iterdir()) == []
    assert main([*argv[:4], str(tmp_path / "map.PNG"), "--text", "hi"]) == 0


def test_cli_draws_for_a_path_that_is_not_utf8(decoder_ckpt, tmp_path, capsys):
    # a file name's byte that is not UTF-8 comes in as a lone surrogate (surrogateescape):
    # the title that names the checkpoint drew it and matplotlib raised a TypeError
    import os
    import shutil

    try:
        ckpt = shutil.copytree(decoder_ckpt, tmp_path / os.fsdecode(b"run\xe9"))
    except (OSError, UnicodeError):
        pytest.skip("the file system takes only UTF-8 names")
    out = tmp_path / "map.png"
    assert main(["attention-map", "--ckpt", str(ckpt), "--text", "hello", "--out",
                 str(out)]) == 0  # fmt: skip
    assert "8 heatmaps" in capsys.readouterr().out
    assert _png_size(out) == _expected_size(2, 4)


def test_each_panel_draws_its_layer_and_head_and_vit_cls_over_the_patches():
    """Panel (row, column) shows the weights of its layer and head: a t x s heatmap, or for a
    ViT grid the [CLS] query's weights over the patches (keys 1..N, [CLS] itself left out)
    laid out as the image's rows x columns of patches. Heads must exist in every grid."""
    g = torch.Generator().manual_seed(0)
    text = AttentionGrid("self", torch.rand(2, 3, 4, 4, generator=g), list("abcd"), list("abcd"))
    image = AttentionGrid("vit", torch.rand(2, 3, 7, 7, generator=g), [], [], patches=(2, 3))
    fig = draw_attention([text, image], layers=[1], heads=[2, 0])
    axes = [fig.axes[i : i + 2] for i in (0, 2)]  # rows: (text, layer 1), (vit, layer 1)
    for c, head in enumerate((2, 0)):
        drawn = torch.as_tensor(axes[0][c].images[0].get_array())
        torch.testing.assert_close(drawn, text.weights[1, head])
        drawn = torch.as_tensor(axes[1][c].images[0].get_array())
        torch.testing.assert_close(drawn, image.weights[1, head, 0, 1:].reshape(2, 3))
    narrow = AttentionGrid("cross", torch.rand(1, 2, 4, 4, generator=g), list("abcd"), list("abcd"))
    with pytest.raises(AttentionMapError, match="--heads 2: the model has 2 heads"):
        draw_attention([text, narrow], heads=[2])


def test_labels_and_titles_with_dollar_signs_are_drawn_as_written(tmp_path):
    # a byte-level BPE token " $$" is not mathtext (it failed to parse), nor is "$x$"
    labels = ["\u2423$$", "$x$", "\\$", "a$b"]
    grid = AttentionGrid("causal self-attention", torch.rand(1, 1, 4, 4), labels, labels)
    fig = draw_attention([grid], title="runs/$$cost$: 4 tokens")
    assert save_png(fig, tmp_path / "map.png").is_file()
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == labels
    assert not any(t.get_parse_math() for t in [*ax.get_xticklabels(), *ax.get_yticklabels()])
    assert not fig._suptitle.get_parse_math() and not ax.title.get_parse_math()


def test_cli_seq2seq_draws_three_kinds_with_the_greedy_target(tmp_path, capsys):
    from attnlab.data.numbers import CharVocab, CharVocabPair
    from attnlab.models.seq2seq import Seq2SeqConfig
    from attnlab.training.checkpoint import save_checkpoint

    vocab = CharVocabPair(CharVocab("0123456789"), CharVocab("abcdefghij -"))
    cfg = Seq2SeqConfig(vocab_size=len(vocab.target), src_vocab_size=len(vocab.source),
                        share_embeddings=False, max_seq_len=16, d_model=32, n_layers=2,
                        n_decoder_layers=1)  # fmt: skip
    model = build_model(cfg).eval()
    path = tmp_path / "numbers"
    save_checkpoint(path, model, RunConfig(model=cfg, task="seq2seq"), vocab)
    out = tmp_path / "s2s.png"
    assert main(["attention-map", "--ckpt", str(path), "--text", "123", "--out", str(out),
                 "--max-new-tokens", "6"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    greedy = vocab.target.decode(model.generate(torch.tensor([[4, 5, 6]]), 6)[0])
    assert f"target (greedy): {greedy}" in printed
    # rows: encoder self-attention (2 layers), decoder self- and cross-attention (1 each)
    assert "16 heatmaps" in printed
    assert _png_size(out) == _expected_size(4, 4)
    assert main(["attention-map", "--ckpt", str(path), "--text", "123", "--out", str(out),
                 "--layers", "1"]) == 0  # fmt: skip
    assert _png_size(out) == _expected_size(1, 4)  # only the encoder has a layer 1
    assert main(["attention-map", "--ckpt", str(path), "--text", "123", "--target", "abc",
                 "--out", str(out)]) == 0  # fmt: skip
    assert "target (given): abc" in capsys.readouterr().out
    assert main(["attention-map", "--ckpt", str(path), "--text", "12", "--target", "xyz",
                 "--out", str(out)]) == 1  # fmt: skip
    assert "--target 'xyz'" in capsys.readouterr().err


def test_cli_seq2seq_too_long_a_target_names_the_option_that_made_it(tmp_path, capsys, monkeypatch):
    """A greedy translation past max_seq_len (--max-new-tokens above it) was reported as
    "--target: N tokens exceed", an option not given; --target-ids as --target too."""
    from attnlab.data.numbers import CharVocab, CharVocabPair
    from attnlab.models.seq2seq import Seq2SeqConfig, Seq2SeqModel
    from attnlab.training.checkpoint import save_checkpoint

    vocab = CharVocabPair(CharVocab("0123456789"), CharVocab("abcdefghij -"))
    cfg = Seq2SeqConfig(vocab_size=len(vocab.target), src_vocab_size=len(vocab.source),
                        share_embeddings=False, max_seq_len=16, d_model=32, n_layers=1)  # fmt: skip
    path = tmp_path / "numbers"
    save_checkpoint(path, build_model(cfg), RunConfig(model=cfg, task="seq2seq"), vocab)
    # a model that never ends its translation: as long as it is allowed
    monkeypatch.setattr(Seq2SeqModel, "generate", lambda self, src, n, **kw: [[5] * n])
    out = tmp_path / "s2s.png"
    argv = ["attention-map", "--ckpt", str(path), "--text", "12", "--out", str(out)]
    for extra, message in [
        (["--max-new-tokens", "40"], "--max-new-tokens 40: the greedy translation has 40 "
         "tokens, past the model's max_seq_len=16 (with BOS); give at most 15"),
        (["--target-ids", ",".join(["5"] * 16)], "--target-ids: 17 tokens exceed"),
    ]:  # fmt: skip
        assert main([*argv, *extra]) == 1
        err = capsys.readouterr().err
        assert err.startswith("attnlab: error: ") and err.count("\n") == 1 and message in err
        assert not out.exists()
    assert main([*argv, "--max-new-tokens", "15"]) == 0  # 15 + BOS fit


@pytest.mark.parametrize("topk", [3, 64])
def test_dsa_gathered_keys_record_the_naive_paths_map(topk):
    # The absorbed DSA path reads only each query's top-k latents; its map is theirs,
    # zero elsewhere, as the naive path's masked softmax gives.
    from attnlab.presets import get_preset

    idx = torch.randint(0, 100, (2, 9))
    recorded = []
    for path in ("naive", "absorbed"):
        cfg = get_preset("deepseek-v32-tiny").override(
            {"attention.mla_path": path, "attention.index_topk": topk}
        )
        torch.manual_seed(0)
        model = build_model(cfg).eval()
        with torch.no_grad(), record_attention(model) as maps:
            model(idx)
        recorded.append(stack_layers(maps)["blocks.attn"])
    torch.testing.assert_close(recorded[1], recorded[0], atol=1e-6, rtol=1e-5)
    assert int((recorded[1][..., -1, :] > 0).sum(-1).max()) <= topk


def test_cli_encoder_classifier_maps_the_input_classify_feeds_it(tmp_path, monkeypatch):
    """An attnlab-trained text classifier reads [CLS] text [SEP] (classify, tag): its map is
    of that input, labelled with the special tokens' names, not of the bare text."""
    import attnlab.cli.attention_map as command
    from attnlab.models.encoder import EncoderConfig
    from attnlab.tasks.text import text_codec
    from attnlab.tokenizers import train_tokenizer
    from attnlab.training.checkpoint import save_checkpoint

    tokenizer = train_tokenizer("char", ["hello world"])
    codec = text_codec(tokenizer)
    cfg = EncoderConfig(vocab_size=codec.vocab_size, max_seq_len=16, d_model=16, n_layers=1,
                        head="sequence", n_labels=2)  # fmt: skip
    path, model = tmp_path / "classifier", build_model(cfg).eval()
    save_checkpoint(path, model, RunConfig(model=cfg, task="text-classification"), tokenizer)
    drawn, text_grids = [], command._text_grids
    monkeypatch.setattr(command, "_text_grids", lambda *a: drawn.append(text_grids(*a)) or drawn[0])
    assert main(["attention-map", "--ckpt", str(path), "--text", "hello",
                 "--out", str(tmp_path / "m.png")]) == 0  # fmt: skip
    ((grid,), _) = drawn[0]
    assert grid.queries == ["[CLS]", "h", "e", "l", "l", "o", "[SEP]"]
    ids = torch.tensor([codec.single(tokenizer.encode("hello"))])
    with torch.no_grad(), record_attention(model) as recorded:
        model(ids)
    torch.testing.assert_close(grid.weights, stack_layers(recorded)["blocks.attn"][:, 0])


def test_stack_layers_groups_by_name_and_orders_layers_by_number():
    """Twelve layers (two digits) recorded in any order: one group per module name with its
    layer index taken out, layers in numeric order (10 after 9)."""
    maps = {}
    for i in [11, 2, 10, 0, 9, 1, 3, 4, 5, 6, 7, 8]:
        maps[f"decoder.{i}.cross_attn"] = torch.full((1, 2, 3, 4), float(i))
        maps[f"decoder.{i}.self_attn"] = torch.full((1, 2, 3, 3), -float(i))
    maps["pool.attn"] = torch.zeros(1, 2, 1, 4)
    stacked = stack_layers(maps)
    assert sorted(stacked) == ["decoder.cross_attn", "decoder.self_attn", "pool.attn"]
    assert stacked["decoder.cross_attn"].shape == (12, 1, 2, 3, 4)
    assert stacked["decoder.cross_attn"][:, 0, 0, 0, 0].tolist() == list(range(12))
    assert stacked["decoder.self_attn"][:, 0, 0, 0, 0].tolist() == [-i for i in range(12)]
    assert stacked["pool.attn"].shape == (1, 1, 2, 1, 4)


def test_a_module_that_runs_twice_while_recording_is_an_error():
    model = tiny_decoder()
    idx = torch.randint(0, 20, (1, 5))
    with pytest.raises(AttentionMapError, match="ran twice"):
        with torch.no_grad(), record_attention(model):
            model(idx)
            model(idx)


def test_panel_rows_heads_fit_every_grid_and_the_panel_limit_is_exact():
    from attnlab.attention_maps import MAX_PANELS

    def grid(layers, heads):
        return AttentionGrid("g", torch.rand(layers, heads, 3, 3), ["a"] * 3, ["b"] * 3)

    rows, heads = panel_rows([grid(2, 4), grid(1, 2)], None, None)
    assert heads == [0, 1] and len(rows) == 3  # the heads every grid has
    with pytest.raises(AttentionMapError, match="--heads 3: the model has 2 heads"):
        panel_rows([grid(2, 4), grid(1, 2)], None, [3])
    rows, heads = panel_rows([grid(MAX_PANELS, 1)], None, None)
    assert len(rows) * len(heads) == MAX_PANELS
    with pytest.raises(AttentionMapError, match=f"{MAX_PANELS + 1} heatmaps"):
        panel_rows([grid(MAX_PANELS + 1, 1)], None, None)


def test_drawn_panels_show_the_weights_asked_for():
    """Each panel shows its layer and head; a patch grid shows query 0 ([CLS]) over keys
    1.. as an image; key labels go under each grid's bottom row, query labels left."""
    torch.manual_seed(0)
    text = AttentionGrid("text", torch.rand(2, 2, 3, 3), ["q0", "q1", "q2"], ["k0", "k1", "k2"])
    image = AttentionGrid("vit", torch.rand(1, 2, 5, 5), ["c"] * 5, ["c"] * 5, patches=(2, 2))
    fig = draw_attention([text, image], heads=[1])
    axes = fig.axes
    assert len(axes) == 3
    for ax, want in zip(axes[:2], text.weights[:, 1]):  # layers 0 and 1, head 1
        assert torch.equal(torch.as_tensor(ax.images[0].get_array()), want)
    shown = torch.as_tensor(axes[2].images[0].get_array())
    assert torch.equal(shown, image.weights[0, 1, 0, 1:].reshape(2, 2))

    def labels(ticks):
        return [t.get_text() for t in ticks]

    assert labels(axes[0].get_xticklabels()) == []  # the grid's next row holds them
    assert labels(axes[1].get_xticklabels()) == ["k0", "k1", "k2"]
    assert labels(axes[0].get_yticklabels()) == ["q0", "q1", "q2"]


def test_token_labels_show_spaces_and_line_breaks():
    assert token_label(" a\nb") == "\u2423a\u21b5b"
    assert token_label("") == "\u2205"
