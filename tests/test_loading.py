"""Memory-lean loading (meta-device build, per-parameter allocation from safetensors), the
optional tokenizer of a checkpoint, and the end-of-sequence tokens of ``generate``.

The reference for every loaded model is the model it was saved from, run the old way:
built normally, its float32 weights cast parameter by parameter (RoPE frequencies kept
float32), so logits must be identical, not merely close."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_model

import attnlab.training.checkpoint as ckpt_module
from attnlab.cli.main import main
from attnlab.config import RunConfig
from attnlab.interop import load_hf, save_hf
from attnlab.models import build_model
from attnlab.models.decoder import DecoderLM
from attnlab.models.encoder import EncoderConfig
from attnlab.models.seq2seq import Seq2SeqConfig, Seq2SeqModel
from attnlab.models.vit import vit_digits
from attnlab.nn.linear import Linear, is_input_major
from attnlab.presets import deepseek_moe_tiny, gpt2_style, llama_style, vaswani_tiny, xl_tiny
from attnlab.tokenizers import train_tokenizer
from attnlab.training import CheckpointError, load_checkpoint, save_checkpoint
from attnlab.weights import SafetensorsFile

TEXT = "the quick brown fox jumps over the lazy dog. THE END!\n"
TOKENIZER = train_tokenizer("char", [TEXT])
V = TOKENIZER.vocab_size

CONFIGS = {
    "gpt2_tied": gpt2_style(vocab_size=V, max_seq_len=32, d_model=32, n_layers=2, n_heads=4),
    "llama_untied": llama_style(
        vocab_size=V, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2
    ),
    "qwen_tied_llama3_rope": llama_style(
        vocab_size=V, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
        qkv_bias=True, tie_embeddings=True, rope_theta=500.0,
    ).override({"position.rope_scaling": "llama3", "position.rope_factor": 4.0,
                "position.rope_original_max_seq_len": 16}),
}  # fmt: skip


def _model(name: str, seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    model = DecoderLM(CONFIGS[name]).eval()
    with torch.no_grad():  # far from the init, so a wrong or missing tensor shows
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(0.5 + torch.rand(p.shape))
            else:
                p.copy_(0.3 * torch.randn(p.shape))
    return model


def _old_way(model: DecoderLM, dtype: torch.dtype | None) -> DecoderLM:
    ref = copy.deepcopy(model)
    if dtype is not None:
        for p in ref.parameters():
            p.data = p.data.to(dtype)
    return ref.eval()


def _check_loaded(model: DecoderLM, ref: DecoderLM, dtype: torch.dtype) -> None:
    assert not model.training
    assert all(p.device.type == "cpu" and p.dtype == dtype for p in model.parameters())
    assert all(b.device.type == "cpu" for b in model.buffers())  # nothing left on meta
    for (name, b), (_, b_ref) in zip(model.named_buffers(), ref.named_buffers()):
        assert b.dtype == torch.float32 and torch.equal(b, b_ref), name  # RoPE inv_freq
    if model.cfg.tie_embeddings:
        assert model.lm_head.weight is model.tok_emb.weight
    for name, m in model.named_modules():
        if isinstance(m, Linear) and not (name == "lm_head" and model.cfg.tie_embeddings):
            assert is_input_major(m.weight), name  # the decode layout survived loading
    idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(idx).logits, ref(idx).logits
    assert theirs.abs().max() > 1.0
    assert torch.equal(ours, theirs)
    # one-token decoding takes the split product on these weights as well
    with torch.no_grad():
        assert model.generate(idx[0].tolist(), 5) == ref.generate(idx[0].tolist(), 5)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_load_hf_equals_old_path(name, dtype, tmp_path):
    model = _model(name)
    save_hf(model, tmp_path)
    loaded = load_hf(tmp_path, dtype=dtype)
    _check_loaded(loaded, _old_way(model, dtype), dtype or torch.float32)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [None, torch.float16])
def test_load_checkpoint_equals_old_path(name, dtype, tmp_path):
    model = _model(name)
    save_checkpoint(tmp_path, model, RunConfig(model=model.cfg), TOKENIZER)
    loaded = load_checkpoint(tmp_path, dtype=dtype).model
    _check_loaded(loaded, _old_way(model, dtype), dtype or torch.float32)


@pytest.mark.parametrize("load", ["checkpoint", "hf"])
def test_float64_load_equals_model_double(load, tmp_path):
    """A float64 model computes its RoPE angles in float64 (as ``model.double()`` does):
    loading in float64 kept the float32 frequency table, angles off by ~1e-7."""
    model = _model("qwen_tied_llama3_rope")
    if load == "hf":
        save_hf(model, tmp_path)
        loaded = load_hf(tmp_path, dtype=torch.float64)
    else:
        save_checkpoint(tmp_path, model, RunConfig(model=model.cfg), TOKENIZER)
        loaded = load_checkpoint(tmp_path, dtype=torch.float64).model
    ref = copy.deepcopy(model).double()
    assert loaded.rope.inv_freq.dtype == torch.float64
    assert torch.equal(loaded.rope.inv_freq, ref.rope.inv_freq)
    idx = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(idx).logits, ref(idx).logits)


def test_checkpoint_stored_in_bf16_loads_as_float32_by_default(tmp_path):
    model = _model("llama_untied")
    half = _old_way(model, torch.bfloat16)
    save_checkpoint(tmp_path, half, RunConfig(model=model.cfg), TOKENIZER)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_slice("tok_emb.weight").get_dtype() == "BF16"
    loaded = load_checkpoint(tmp_path).model
    _check_loaded(loaded, _old_way(half, torch.float32), torch.float32)


def test_linear_load_state_dict_assign_keeps_layout():
    torch.manual_seed(0)
    plain = torch.nn.Linear(64, 48)
    lin = Linear(64, 48)
    lin.load_state_dict(plain.state_dict(), assign=True)
    assert is_input_major(lin.weight) and lin.weight.requires_grad
    x = torch.randn(3, 64)
    torch.testing.assert_close(lin(x), plain(x), rtol=1e-5, atol=1e-6)  # GEMM order differs
    # A weight that was not input-major (tied to an embedding) is not re-laid out.
    model = DecoderLM(CONFIGS["gpt2_tied"])
    model.load_state_dict(copy.deepcopy(model.state_dict()), assign=True)
    assert model.blocks[0].attn.qkv.weight.stride() == (1, 3 * 32)


def test_safetensors_reader_chunks_any_layout(tmp_path, monkeypatch):
    """Reads through a buffer smaller than the tensor, into strided and converted
    destinations, equal the safetensors library's own reading."""
    from safetensors.torch import load_file, save_file

    import attnlab.weights as weights

    # d: a row (160 bytes) wider than a chunk
    tensors = {"a": torch.randn(37, 11), "b": torch.randn(5).bfloat16(), "c": torch.tensor(3),
               "d": torch.randn(3, 40)}  # fmt: skip
    save_file(tensors, tmp_path / "x.safetensors")
    monkeypatch.setattr(weights, "CHUNK_BYTES", 64)
    f = SafetensorsFile(tmp_path / "x.safetensors")
    ref = load_file(tmp_path / "x.safetensors")
    strided = torch.empty(11, 37).t()  # input-major (37, 11)
    f.read_into("a", strided)
    assert torch.equal(strided, ref["a"])
    half = torch.empty(37, 11, dtype=torch.float16)
    f.read_into("a", half)
    assert torch.equal(half, ref["a"].half())
    assert torch.equal(f.read("b"), ref["b"]) and torch.equal(f.read("c"), ref["c"])
    wide = torch.empty(3, 40, dtype=torch.float64)
    f.read_into("d", wide)
    assert torch.equal(wide, ref["d"].double())
    with open(tmp_path / "x.safetensors", "r+b") as fh:  # truncated data
        fh.truncate(os.path.getsize(tmp_path / "x.safetensors") - 4)
    with pytest.raises(weights.WeightsFileError, match="truncated"):
        SafetensorsFile(tmp_path / "x.safetensors")


def test_safetensors_reader_reads_a_range_of_rows(tmp_path, monkeypatch):
    """``rows=(start, stop)`` reads those leading rows alone, straight into place or through
    the buffer (a strided, converted destination); rows outside the tensor are refused."""
    from safetensors.torch import save_file

    import attnlab.weights as weights

    t = torch.randn(9, 5)
    save_file({"a": t, "v": torch.randn(7)}, tmp_path / "r.safetensors")
    monkeypatch.setattr(weights, "CHUNK_BYTES", 24)  # (a row is 20 bytes: one at a time)
    f = SafetensorsFile(tmp_path / "r.safetensors")
    direct = torch.empty(3, 5)
    f.read_into("a", direct, rows=(2, 5))
    assert torch.equal(direct, t[2:5])
    strided = torch.empty(5, 4, dtype=torch.float64).t()  # (4, 5), input-major
    f.read_into("a", strided, rows=(5, 9))
    assert torch.equal(strided, t[5:9].double())
    one = torch.empty(2)
    f.read_into("v", one, rows=(5, 7))
    assert torch.equal(one, f.read("v")[5:7])
    f.read_into("a", torch.empty(0, 5), rows=(4, 4))  # no rows: nothing read
    with pytest.raises(ValueError, match="rows 8:10 are not rows of its shape"):
        f.read_into("a", torch.empty(2, 5), rows=(8, 10))
    with pytest.raises(ValueError, match="destination shape"):
        f.read_into("a", torch.empty(3, 5), rows=(0, 2))


def test_safetensors_reader_reads_zero_size_tensors_into_any_dtype(tmp_path):
    """A tensor with no elements (a zero-width dimension) reads into a destination of its
    own or another dtype, even placed last in the file: it read one row's bytes per row
    (past the end of the data) when converting."""
    from safetensors.torch import load_file, save_file

    tensors = {"a": torch.randn(3, 4), "empty": torch.zeros(5, 0), "none": torch.zeros(0, 2)}
    save_file(tensors, tmp_path / "z.safetensors")
    f = SafetensorsFile(tmp_path / "z.safetensors")
    ref = load_file(tmp_path / "z.safetensors")
    for name in ("empty", "none"):
        for dtype in (torch.float32, torch.float16, torch.float64):
            dest = torch.empty(ref[name].shape, dtype=dtype)
            f.read_into(name, dest)
            assert dest.shape == ref[name].shape
        assert f.read(name).shape == ref[name].shape
    assert torch.equal(f.read("a"), ref["a"])


def test_safetensors_reader_reads_every_dtype_and_checks_offsets(tmp_path):
    """Each dtype the reader knows reads back as the safetensors library reads it (same
    dtype, same values), and a header whose offsets disagree with its shape is refused."""
    import struct

    from safetensors.torch import load_file, save_file

    import attnlab.weights as weights

    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]  # fmt: skip
    g = torch.Generator().manual_seed(0)
    tensors = {str(dtype): (torch.randn(3, 5, generator=g) * 50).to(dtype) for dtype in dtypes}
    save_file(tensors, tmp_path / "all.safetensors")
    f = SafetensorsFile(tmp_path / "all.safetensors")
    ref = load_file(tmp_path / "all.safetensors")
    for name in tensors:
        got = f.read(name)
        assert got.dtype == ref[name].dtype and torch.equal(got, ref[name]), name
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}).encode()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(weights.WeightsFileError, match="'a' has inconsistent offsets"):
        SafetensorsFile(bad)


def test_materialize_keeps_flags_full_precision_and_fills_saved_buffers():
    """``materialize`` on a model built on the meta device: a frozen parameter stays
    frozen, one a module names in ``full_precision`` stays float32 under a bf16 load, and
    persistent buffers (a batch norm's running statistics) are filled like parameters."""
    from torch import nn

    from attnlab.weights import materialize, parameters_on_meta

    class Net(nn.Module):
        full_precision = ("kept",)

        def __init__(self):
            super().__init__()
            self.frozen = nn.Parameter(torch.randn(3, 4))
            self.frozen.requires_grad_(False)
            self.kept = nn.Parameter(torch.randn(4))
            self.lin = nn.Linear(4, 4)
            self.norm = nn.BatchNorm1d(4)

    torch.manual_seed(0)
    ref = Net()
    ref.norm(torch.randn(8, 4) * 3 + 1)  # running statistics away from their start
    state = ref.state_dict()
    with parameters_on_meta():
        net = Net()
    assert net.lin.weight.is_meta and not net.frozen.requires_grad
    materialize(net, lambda name, t: t.copy_(state[name]), dtype=torch.bfloat16)
    assert not net.frozen.requires_grad and net.lin.weight.requires_grad
    assert net.kept.dtype == torch.float32 and torch.equal(net.kept, ref.kept)
    assert net.lin.weight.dtype == torch.bfloat16
    torch.testing.assert_close(net.lin.weight, ref.lin.weight.bfloat16(), rtol=0, atol=0)
    assert net.norm.num_batches_tracked.item() == 1
    torch.testing.assert_close(net.norm.running_mean, ref.norm.running_mean, rtol=0, atol=0)
    torch.testing.assert_close(net.norm.running_var, ref.norm.running_var, rtol=0, atol=0)


def test_checkpoint_misshaped_tensor_names_both_shapes(tmp_path):
    from safetensors.torch import load_file, save_file

    model = _model("llama_untied")
    save_checkpoint(tmp_path, model, RunConfig(model=model.cfg), TOKENIZER)
    file = tmp_path / "model.safetensors"
    with safe_open(str(file), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(file)
    tensors["norm.weight"] = torch.ones(31)
    save_file(tensors, file, metadata=metadata)
    with pytest.raises(CheckpointError, match=r"norm\.weight has shape \(31,\).* \(32,\)"):
        load_checkpoint(tmp_path)


# --------------------------------------------------------------------------- tied weights

# Every family that ties parameters (a head tied to its token embedding; Marian's target
# embedding shared with the source's or not), as PyTorch's own loading paths meet them.
TIED = {
    "gpt2": lambda: CONFIGS["gpt2_tied"],
    "llama_tied": lambda: CONFIGS["qwen_tied_llama3_rope"],
    "vaswani": lambda: vaswani_tiny().override({"vocab_size": V, "d_model": 32}),
    "xl": lambda: xl_tiny().override({"vocab_size": V, "d_model": 32, "mem_len": 8}),
    "bert_mlm": lambda: EncoderConfig(vocab_size=V, max_seq_len=32, d_model=32, n_layers=2),
    "seq2seq_shared": lambda: Seq2SeqConfig(vocab_size=V, max_seq_len=32, d_model=32, n_layers=2),
    "marian_separate": lambda: Seq2SeqConfig(
        vocab_size=V, max_seq_len=32, d_model=32, n_layers=2, share_embeddings=False,
        sinusoid_layout="split", final_logits_bias=True,
    ),
}  # fmt: skip
TIED_TASKS = {"xl": "lm-stream", "encoder": "mlm", "seq2seq": "seq2seq"}


def _tied_batch(model, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(3, V, (2, 10), generator=g)
    if isinstance(model, Seq2SeqModel):
        tgt = torch.randint(3, V, (2, 7), generator=g)
        return {"src": idx, "tgt": tgt, "targets": tgt.roll(-1, 1)}
    return {"idx": idx, "targets": idx.roll(-1, 1)}


def _trained_one_step(model, batch) -> torch.Tensor:
    """Logits after one AdamW step on ``batch`` (large enough to move every weight)."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    model(**batch).loss.backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        return model(**{k: v for k, v in batch.items() if k != "targets"}).logits


def _loaded_the_pytorch_way(cfg, twin, path: str, tmp_path):
    """``cfg``'s model given ``twin``'s weights by a standard PyTorch loading path."""
    state = {k: v.clone() for k, v in twin.state_dict().items()}
    if path == "assign_file":  # safetensors stores a tied tensor once, under one name
        save_model(twin, str(tmp_path / "model.safetensors"))
        state = load_file(str(tmp_path / "model.safetensors"))
        assert len(state) < len(twin.state_dict())
    if path == "to_meta":  # built, then moved to the meta device
        model = build_model(cfg).to("meta")
    else:
        with torch.device("meta"):
            model = build_model(cfg)
    if path.startswith("assign"):
        # strict: a tied name left out is filled; RoPE's frequencies, in no state dict, are
        # recomputed on the loaded parameters' device
        model.load_state_dict(state, assign=True)
        return model
    model.to_empty(device="cpu")
    for name, source in model.tied_parameters().items():  # to_empty keeps them too
        assert model.get_parameter(name) is model.get_parameter(source), name
    model.load_state_dict(state)
    model.tie_weights()
    return model


@pytest.mark.parametrize("path", ["assign", "assign_file", "to_empty", "to_meta"])
@pytest.mark.parametrize("family", list(TIED))
def test_pytorch_loading_paths_keep_ties(family, path, tmp_path):
    """Meta-device init + ``load_state_dict(assign=True)`` (from a state dict, or from a
    safetensors file that stores a tied tensor once), and ``to_empty`` (after building on
    the meta device or ``model.to("meta")``) + ``load_state_dict`` + ``tie_weights()``
    give tied parameters that are one Parameter: one optimizer step later the model still
    equals its normally built twin trained the same way, and its checkpoint reloads with
    the same logits. (They were two Parameters: the step moved them apart, and the save,
    storing the tied tensor once, reloaded with logits about 0.1 off.)"""
    cfg = TIED[family]()
    torch.manual_seed(0)
    twin = build_model(cfg)
    ties = twin.tied_parameters()
    assert "lm_head.weight" in ties or "head.decoder.weight" in ties
    model = _loaded_the_pytorch_way(cfg, twin, path, tmp_path)
    for name, source in ties.items():
        assert model.get_parameter(name) is model.get_parameter(source), name
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in twin.named_parameters()]
    assert not any(p.is_meta for p in model.parameters())

    batch = _tied_batch(twin)
    logits = _trained_one_step(model, batch)
    assert torch.equal(logits, _trained_one_step(twin, batch))
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        assert torch.equal(p, q), name

    task = TIED_TASKS.get(cfg.arch, "lm")
    save_checkpoint(tmp_path / "ckpt", model, RunConfig(model=cfg, task=task), None)
    loaded = load_checkpoint(tmp_path / "ckpt").model
    inputs = {k: v for k, v in batch.items() if k != "targets"}
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, logits)


@pytest.mark.parametrize("assign", [False, True])
def test_a_state_dict_giving_tied_parameters_different_values_is_refused(assign):
    """A state dict whose head and embedding differ (an untied model's) cannot load into a
    model whose config ties them: one of the two would be dropped, and which one depended
    on ``assign`` (the head's values copied last, the embedding's re-tied). Equal values
    (a cloned tied state dict) load."""
    cfg = CONFIGS["gpt2_tied"]
    torch.manual_seed(0)
    twin, model = build_model(cfg), build_model(cfg)
    state = {k: v.clone() for k, v in twin.state_dict().items()}
    model.load_state_dict(state, assign=assign)
    assert torch.equal(model.lm_head.weight, twin.lm_head.weight)
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    message = r"lm_head\.weight is tied to tok_emb\.weight .* different values"
    with pytest.raises(RuntimeError, match=message):
        build_model(cfg).load_state_dict(state, assign=assign)


@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("stored", ["tok_emb.weight", "lm_head.weight"])
def test_a_state_dict_holding_either_tied_name_once_loads_strictly(stored, assign):
    """A state dict that holds the tied tensor once, under either name (safetensors keeps
    one of the two; a Hugging Face checkpoint leaves out the head), loads strictly into
    the tied model: the missing name is filled from the one given, and the model computes
    what its twin does."""
    torch.manual_seed(0)
    twin = build_model(CONFIGS["gpt2_tied"]).eval()
    state = {k: v.clone() for k, v in twin.state_dict().items()}
    other = "lm_head.weight" if stored == "tok_emb.weight" else "tok_emb.weight"
    del state[other]
    torch.manual_seed(1)
    model = build_model(CONFIGS["gpt2_tied"]).eval()
    model.load_state_dict(state, assign=assign)
    assert model.lm_head.weight is model.tok_emb.weight
    assert torch.equal(model.tok_emb.weight, twin.tok_emb.weight)
    idx = _tied_batch(twin)["idx"]
    with torch.no_grad():
        assert torch.equal(model(idx).logits, twin(idx).logits)


@pytest.mark.parametrize("wrap", ["compiled", "container"])
def test_a_wrapped_tied_model_loads_and_refuses_by_its_prefixed_names(wrap):
    """Inside a wrapper (``torch.compile``'s, keys under ``_orig_mod.``; a module holding the
    model as a child) the state dict's names carry a prefix: the tied tensor stored once
    still loads strictly, and different values for the tied names are still refused."""
    torch.manual_seed(0)
    twin = build_model(CONFIGS["gpt2_tied"]).eval()

    def wrapped():
        model = build_model(CONFIGS["gpt2_tied"])
        return torch.compile(model) if wrap == "compiled" else torch.nn.ModuleDict({"lm": model})

    outer = wrapped()
    prefix = "_orig_mod." if wrap == "compiled" else "lm."
    state = {prefix + k: v.clone() for k, v in twin.state_dict().items()}
    del state[prefix + "lm_head.weight"]
    outer.load_state_dict(state)
    model = outer._orig_mod if wrap == "compiled" else outer["lm"]
    assert model.lm_head.weight is model.tok_emb.weight
    assert torch.equal(model.lm_head.weight, twin.lm_head.weight)
    state[prefix + "lm_head.weight"] = twin.lm_head.weight.detach() + 1
    with pytest.raises(RuntimeError, match=r"lm_head\.weight is tied to .* different values"):
        wrapped().load_state_dict(state)


def test_tied_entries_are_compared_by_exact_value():
    """The pre-load check of a tied pair compares values exactly: one ulp apart is
    different values (refused); a NaN in both at the same place, the same values in another
    dtype, or a state dict of shapes only (meta tensors, an untied model's among them) is
    not; a transposed view of the same memory is other values. Shapes that differ are left
    to load_state_dict's own size check, which names the tensor."""
    cfg = CONFIGS["gpt2_tied"].override({"vocab_size": 32})  # square: V == d_model
    torch.manual_seed(0)
    twin = build_model(cfg)
    message = r"lm_head\.weight is tied to tok_emb\.weight .* different values"

    def state(**entries):
        out = {k: v.clone() for k, v in twin.state_dict().items()}
        out.update(entries)
        return out

    emb = twin.tok_emb.weight.detach()
    ulp = emb.clone()
    ulp[3, 5] = torch.nextafter(ulp[3, 5], torch.tensor(float("inf")))
    with pytest.raises(RuntimeError, match=message):
        build_model(cfg).load_state_dict(state(**{"lm_head.weight": ulp}))
    transposed = emb.clone()
    with pytest.raises(RuntimeError, match=message):  # same memory, other values
        build_model(cfg).load_state_dict(
            state(**{"tok_emb.weight": transposed, "lm_head.weight": transposed.t()})
        )
    nan = emb.clone()
    nan[1, 2] = float("nan")
    model = build_model(cfg)
    model.load_state_dict(state(**{"tok_emb.weight": nan, "lm_head.weight": nan.clone()}))
    assert model.lm_head.weight is model.tok_emb.weight
    assert torch.equal(model.tok_emb.weight.isnan(), nan.isnan())
    model = build_model(cfg)
    model.load_state_dict(state(**{"lm_head.weight": emb.double()}))  # the same values
    assert torch.equal(model.lm_head.weight, emb)
    wider = torch.randn(33, 32)
    with pytest.raises(RuntimeError, match=r"size mismatch for tok_emb\.weight"):
        build_model(cfg).load_state_dict(state(**{"tok_emb.weight": wider}))
    with torch.device("meta"):
        model = build_model(cfg)
        shapes = build_model(cfg.override({"tie_embeddings": False})).state_dict()
    assert shapes["lm_head.weight"].stride() != shapes["tok_emb.weight"].stride()
    for assign in (False, True):
        model.load_state_dict(shapes, assign=assign)
        assert model.lm_head.weight is model.tok_emb.weight and model.lm_head.weight.is_meta


def test_conversions_keep_a_head_untied_by_hand_apart():
    """A conversion re-ties only the pairs that were one Parameter before it: a head the
    user untied (to train it on its own) keeps its Parameter and values through ``.to()``,
    as in any module, and stays apart through ``to("meta")`` (a save then refuses it).
    ``.to(float64)`` made it the embedding again, its own values silently dropped."""
    torch.manual_seed(0)
    model = build_model(CONFIGS["gpt2_tied"])
    head = torch.nn.Parameter(model.lm_head.weight.detach() + 1)
    model.lm_head.weight = head
    model.to(torch.float64)
    assert model.lm_head.weight is head and head.dtype == torch.float64
    assert not torch.equal(head, model.tok_emb.weight)
    model.to("meta")
    assert model.lm_head.weight is not model.tok_emb.weight


# --------------------------------------------------------------------------- buffers

# Every family with non-persistent buffers, which no state dict holds: RoPE frequencies
# (decoder, encoder) and MoE token counts (every family built of blocks, which may take MoE
# feed-forwards).
MOE = {
    "ffn.kind": "moe",
    "ffn.n_routed_experts": 4,
    "ffn.n_activated_experts": 2,
    "ffn.moe_hidden_dim": 16,
    "ffn.router": "deepseek-v3",
}
BUFFERED = {
    "llama3_rope": lambda: CONFIGS["qwen_tied_llama3_rope"],
    "deepseek_mla_moe": lambda: deepseek_moe_tiny().override({"vocab_size": V, "max_seq_len": 32}),
    "bert_rope_moe": lambda: EncoderConfig(
        vocab_size=V, max_seq_len=32, d_model=32, n_layers=2
    ).override({"position.kind": "rope", **MOE}),
    "vaswani_moe": lambda: vaswani_tiny().override({"vocab_size": V, "d_model": 32, **MOE}),
    "xl_moe": lambda: xl_tiny().override({"vocab_size": V, "d_model": 32, "mem_len": 8, **MOE}),
    "vit_moe": lambda: vit_digits().override(MOE),
}  # fmt: skip


def _buffered_batch(model) -> dict[str, torch.Tensor]:
    if model.cfg.arch != "vit":
        return _tied_batch(model)
    g = torch.Generator().manual_seed(1)
    images = torch.randn(2, model.cfg.channels, model.cfg.image_size, model.cfg.width, generator=g)
    return {"images": images, "targets": torch.tensor([3, 7])}


def _check_same_buffers_and_outputs(model, twin) -> None:
    """``model``'s buffers are bit for bit ``twin``'s (real, same dtype), its logits equal,
    and a training forward pass counts the same MoE loads."""
    non_persistent = set(dict(twin.named_buffers())) - set(twin.state_dict())
    assert non_persistent  # the family has some: a missing recomputation shows
    assert [n for n, _ in model.named_buffers()] == [n for n, _ in twin.named_buffers()]
    for (name, b), (_, ref) in zip(model.named_buffers(), twin.named_buffers()):
        assert b.device.type == "cpu" and b.dtype == ref.dtype, (name, b.device, b.dtype)
        assert torch.equal(b, ref), name
    batch = _buffered_batch(twin)
    inputs = {k: v for k, v in batch.items() if k != "targets"}
    model.eval()
    twin.eval()
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, twin(**inputs).logits)
        model.train()
        twin.train()
        assert torch.equal(model(**batch).loss, twin(**batch).loss)
    for (name, b), (_, ref) in zip(model.named_buffers(), twin.named_buffers()):
        assert torch.equal(b, ref), name  # the loads a balancing step reads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("family", list(BUFFERED))
def test_meta_init_and_assign_load_recompute_non_persistent_buffers(family, dtype):
    """The standard PyTorch meta-device loading pattern (build on meta, ``.to(dtype)`` there,
    ``load_state_dict(state, assign=True)``) gives the model built normally: the buffers no
    state dict holds are recomputed on the parameters' device in their own dtype (RoPE
    frequencies exact in float64, MoE counts float32 in a bf16 model). They stayed on the
    meta device: forward raised "Tensor on device meta is not on the expected device cpu",
    or, without RoPE, the MoE loads of a training step were never counted."""
    cfg = BUFFERED[family]()
    torch.manual_seed(0)
    twin = build_model(cfg).to(dtype)
    state = {k: v.clone() for k, v in twin.state_dict().items()}
    with torch.device("meta"):
        model = build_model(cfg)
    model.to(dtype).load_state_dict(state, assign=True)
    assert not any(p.is_meta for p in model.parameters())
    _check_same_buffers_and_outputs(model, twin)


@pytest.mark.parametrize("family", [f for f in BUFFERED if BUFFERED[f]().ffn.kind == "moe"])
def test_to_empty_then_load_recomputes_non_persistent_buffers(family):
    """``to_empty`` + ``load_state_dict``: the state dict refills what it holds, and the model
    recomputes the rest (RoPE's table in its own ``_apply``, MoE counts after ``to_empty``):
    MoE counts were left as uninitialised memory (here NaN) and summed onto."""
    cfg = BUFFERED[family]()
    torch.manual_seed(0)
    twin = build_model(cfg)
    with torch.device("meta"):
        model = build_model(cfg)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # uninitialised memory is filled with NaN
    try:
        model.to_empty(device="cpu")
    finally:
        torch.use_deterministic_algorithms(deterministic)
    model.load_state_dict(twin.state_dict())
    _check_same_buffers_and_outputs(model, twin)


@pytest.mark.parametrize("family", ["llama3_rope", "vit_moe"])
def test_a_model_left_on_meta_stays_there(family):
    """Loading a meta state dict (``assign`` or not) into a meta model leaves every tensor on
    the meta device, without error; a real state dict loaded next makes it whole."""
    cfg = BUFFERED[family]()
    with torch.device("meta"):
        model = build_model(cfg)
        shapes = build_model(cfg).state_dict()
    for assign in (False, True):
        model.load_state_dict(shapes, assign=assign)
        assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    torch.manual_seed(0)
    twin = build_model(cfg)
    model.load_state_dict({k: v.clone() for k, v in twin.state_dict().items()}, assign=True)
    _check_same_buffers_and_outputs(model, twin)


@pytest.mark.parametrize("assign", [False, True])
def test_loading_into_a_real_model_keeps_its_non_persistent_buffers(assign):
    """Only buffers left on the meta device are recomputed after ``load_state_dict``: a real
    model's own (the MoE token counts a training pass has gathered for its next balancing
    update) are neither zeroed nor replaced by loading weights into it."""
    cfg = BUFFERED["deepseek_mla_moe"]()
    torch.manual_seed(0)
    model = build_model(cfg).train()
    model(**_tied_batch(model))  # counts the tokens each expert took
    counts = {n: b for n, b in model.named_buffers() if n.endswith(".load")}
    assert counts and all(b.sum() > 0 for b in counts.values())
    before = {n: b.clone() for n, b in counts.items()}
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=assign)
    for name, b in model.named_buffers():
        if name in counts:
            assert b is counts[name] and torch.equal(b, before[name]), name


# --------------------------------------------------------------------------- tokenizer


def test_checkpoint_without_tokenizer(tmp_path):
    model = _model("gpt2_tied")
    cfg = RunConfig(model=model.cfg)
    save_checkpoint(tmp_path, model, cfg, None)
    assert not (tmp_path / "tokenizer.json").exists()
    loaded = load_checkpoint(tmp_path)
    assert loaded.tokenizer is None
    _check_loaded(loaded.model, model, torch.float32)
    # With one, then without: the old tokenizer.json goes, and is never read as this one's.
    save_checkpoint(tmp_path, model, cfg, TOKENIZER)
    assert load_checkpoint(tmp_path).tokenizer.to_json() == TOKENIZER.to_json()
    save_checkpoint(tmp_path, model, cfg, None)
    assert not (tmp_path / "tokenizer.json").exists()
    assert load_checkpoint(tmp_path).tokenizer is None
    # A checkpoint that had one must still have it.
    save_checkpoint(tmp_path, model, cfg, TOKENIZER)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json is missing"):
        load_checkpoint(tmp_path)


def test_tokenizer_less_save_killed_during_move(tmp_path, monkeypatch):
    """Killed after its commit point, with the old tokenizer.json still in the folder: the
    reader sees the new checkpoint, without a tokenizer."""
    model = _model("gpt2_tied")
    cfg = RunConfig(model=model.cfg)
    save_checkpoint(tmp_path, model, cfg, TOKENIZER, {"step": 1})
    real_replace = os.replace
    calls = {"n": 0}

    def dies_after_two(src, dst):
        calls["n"] += 1
        if calls["n"] > 2:  # config and weights moved, state not yet
            raise KeyboardInterrupt("killed")
        real_replace(src, dst)

    monkeypatch.setattr(ckpt_module.os, "replace", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, model, cfg, None, {"step": 2})
    monkeypatch.setattr(ckpt_module.os, "replace", real_replace)
    assert (tmp_path / "tokenizer.json").exists()  # stale, from the first save
    loaded = load_checkpoint(tmp_path, with_state=True)
    assert loaded.state["step"] == 2 and loaded.tokenizer is None


# --------------------------------------------------------------------------- CLI


def _run(argv: list[str], capsys) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def test_generate_stops_at_eos(tmp_path, capsys):
    model = _model("llama_untied", seed=3)
    prompt = "the "
    ids = TOKENIZER.encode(prompt)
    greedy = model.generate(ids, 8)
    assert len(set(greedy[:3])) > 1 or greedy[0] != greedy[1]
    hf = tmp_path / "hf"
    save_hf(model, hf)
    TOKENIZER.save(hf / "tokenizer.json")
    args = ["generate", "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "8"]

    def continuation(folder, *extra) -> list[int]:
        text = _run([*args, "--ckpt", str(folder), *extra], capsys)
        assert text.startswith(prompt) and text.endswith("\n")
        return TOKENIZER.encode(text[len(prompt) : -1]) if text[len(prompt) : -1] else []

    assert continuation(hf) == greedy  # config.json from save_hf: eos_token_id null
    stop = greedy[2]
    first = greedy.index(stop)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "eos_token_id": stop}))
    assert continuation(hf) == greedy[:first]  # an int in config.json
    assert continuation(hf, "--ignore-eos") == greedy
    (hf / "config.json").write_text(json.dumps(config))
    gen = {"eos_token_id": [V + 5, stop]}
    (hf / "generation_config.json").write_text(json.dumps(gen))
    assert continuation(hf) == greedy[:first]  # a list in generation_config.json
    # An imported checkpoint keeps the source's end-of-sequence tokens; bf16 on the way.
    ckpt = tmp_path / "ckpt"
    _run(["import-hf", str(hf), str(ckpt), "--dtype", "bfloat16"], capsys)
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert f.get_slice("tok_emb.weight").get_dtype() == "BF16"
    assert json.loads((ckpt / "generation_config.json").read_text()) == gen
    bf16 = _old_way(model, torch.bfloat16).generate(ids, 8, stop_tokens=[stop])
    assert continuation(ckpt, "--dtype", "bfloat16") == bf16
    exported = tmp_path / "exported"
    _run(["export-hf", str(ckpt), str(exported)], capsys)
    assert json.loads((exported / "generation_config.json").read_text()) == gen


def test_generate_samples_by_its_own_options_not_generation_config(tmp_path, capsys):
    """From generation_config.json ``generate`` takes the end-of-sequence tokens only: the
    file's do_sample, temperature, top_k, top_p, num_beams and lengths change nothing; how
    to sample is always the command's own options."""
    model = _model("llama_untied", seed=3)
    prompt = "the "
    hf = tmp_path / "hf"
    save_hf(model, hf)
    TOKENIZER.save(hf / "tokenizer.json")
    args = ["generate", "--ckpt", str(hf), "--prompt", prompt, "--max-new-tokens", "8"]
    runs = [["--temperature", "0"], ["--temperature", "0.9", "--seed", "3"],
            ["--temperature", "0", "--num-beams", "2"]]  # fmt: skip

    def outputs() -> list[str]:
        return [_run([*args, *extra], capsys) for extra in runs]

    plain = outputs()
    greedy = model.generate(TOKENIZER.encode(prompt), 8)
    assert plain[0] == prompt + TOKENIZER.decode(greedy) + "\n"
    sampling = {"do_sample": True, "temperature": 7.0, "top_k": 2, "top_p": 0.3,
                "num_beams": 5, "max_new_tokens": 2, "max_length": 3}  # fmt: skip
    (hf / "generation_config.json").write_text(json.dumps(sampling))
    assert outputs() == plain


def test_eval_dtype(tmp_path, capsys):
    model = _model("gpt2_tied")
    save_checkpoint(tmp_path, model, RunConfig(model=model.cfg), TOKENIZER)
    data = tmp_path / "text.txt"
    data.write_text(TEXT * 3)
    out = {}
    for dtype in ("float32", "bfloat16"):
        argv = ["eval", "--ckpt", str(tmp_path), "--data", str(data), "--dtype", dtype]
        out[dtype] = json.loads(_run([*argv, "--block-size", "16", "--json"], capsys))
    assert out["bfloat16"]["tokens"] == out["float32"]["tokens"]
    assert abs(out["bfloat16"]["loss"] - out["float32"]["loss"]) < 0.05 * out["float32"]["loss"]
    assert out["bfloat16"]["loss"] != out["float32"]["loss"]  # really ran in bf16
