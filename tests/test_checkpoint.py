"""Checkpoint io: round trip, crash safety, no unpickling, clear errors."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch

import attnlab.training.checkpoint as ckpt_module
from attnlab.config import DataConfig, RunConfig, TrainConfig
from attnlab.models import build_model
from attnlab.models.loadable import UntiedWeightsError
from attnlab.presets import gpt2_style, llama_style
from attnlab.tokenizers import train_tokenizer
from attnlab.training import CheckpointError, load_checkpoint, save_checkpoint

TEXT = "the quick brown fox jumps over the lazy dog. THE END!\n"


def make_run(tie: bool = True, seed: int = 0):
    tokenizer = train_tokenizer("char", [TEXT])
    if tie:
        model_cfg = gpt2_style(
            vocab_size=tokenizer.vocab_size, max_seq_len=16, d_model=16, n_layers=1, n_heads=2
        )
    else:
        model_cfg = llama_style(
            vocab_size=tokenizer.vocab_size,
            max_seq_len=16,
            d_model=16,
            n_layers=1,
            n_heads=2,
            n_kv_heads=1,
            multiple_of=8,
        )
    cfg = RunConfig(model=model_cfg, train=TrainConfig(batch_size=3), data=DataConfig())
    torch.manual_seed(seed)
    return build_model(cfg.model), cfg, tokenizer


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("tie", [True, False])
def test_round_trip(tmp_path, tie):
    model, cfg, tokenizer = make_run(tie)
    state = {"step": 7, "rng": torch.get_rng_state(), "nested": [{"a": 1.5, "b": None}]}
    save_checkpoint(tmp_path, model, cfg, tokenizer, state)
    loaded = load_checkpoint(tmp_path, with_state=True)
    assert loaded.config == cfg
    assert loaded.tokenizer.to_json() == tokenizer.to_json()
    assert_same_weights(weights(loaded.model), weights(model))
    assert not loaded.model.training
    if tie:  # tied weights are stored once and tied again on load
        assert loaded.model.lm_head.weight is loaded.model.tok_emb.weight
    x = torch.randint(0, tokenizer.vocab_size, (2, 9))
    model.eval()
    torch.testing.assert_close(loaded.model(x).logits, model(x).logits, rtol=0, atol=0)
    assert loaded.state["step"] == 7 and loaded.state["nested"] == [{"a": 1.5, "b": None}]
    assert torch.equal(loaded.state["rng"], state["rng"])
    assert load_checkpoint(tmp_path).state is None  # with_state=False
    # No trainer state given: loads with state None, and is still complete.
    save_checkpoint(tmp_path / "bare", model, cfg, tokenizer)
    assert load_checkpoint(tmp_path / "bare", with_state=True).state is None


def test_a_model_whose_tied_weights_came_apart_is_refused(tmp_path):
    """The config ties the head to the embedding but the head is a Parameter of its own
    (replaced, or made by a loading path that did not re-tie): the file stores a tied
    tensor once, so one of the two would be lost. The save refuses before writing
    anything, naming both and the fix; after ``model.tie_weights()`` it saves."""
    model, cfg, tokenizer = make_run(tie=True)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() + 0.1)
    message = r"lm_head\.weight is not the same tensor as tok_emb\.weight.*model\.tie_weights\(\)"
    with pytest.raises(UntiedWeightsError, match=message):
        save_checkpoint(tmp_path / "ckpt", model, cfg, tokenizer)
    assert not (tmp_path / "ckpt").exists()
    model.tie_weights()
    assert model.lm_head.weight is model.tok_emb.weight
    save_checkpoint(tmp_path / "ckpt", model, cfg, tokenizer)
    x = torch.randint(0, tokenizer.vocab_size, (2, 9))
    with torch.no_grad():
        expected = model.eval()(x).logits
        assert torch.equal(load_checkpoint(tmp_path / "ckpt").model(x).logits, expected)
    # An identity check, no data read: a model on the meta device is checked as well.
    with torch.device("meta"):
        meta = build_model(cfg.model)
    meta.lm_head.weight = torch.nn.Parameter(torch.empty_like(meta.tok_emb.weight))
    with pytest.raises(UntiedWeightsError, match=message):
        save_checkpoint(tmp_path / "meta", meta, cfg, tokenizer)


def test_a_compiled_model_whose_tied_weights_came_apart_is_refused(tmp_path):
    """The trainer saves the model as it holds it, wrapped by ``torch.compile``: the check
    looks through the wrapper at the model's own ties (the wrapper ties nothing), so an
    untied head is refused there too, before anything is written."""
    model, cfg, tokenizer = make_run(tie=True)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() + 0.1)
    with pytest.raises(UntiedWeightsError, match=r"lm_head\.weight .* tok_emb\.weight"):
        save_checkpoint(tmp_path / "ckpt", torch.compile(model), cfg, tokenizer)
    assert not (tmp_path / "ckpt").exists()


def test_failure_before_commit_keeps_previous(tmp_path, monkeypatch):
    """A save that dies while writing its files leaves the previous checkpoint intact."""
    model_a, cfg, tokenizer = make_run(seed=0)
    save_checkpoint(tmp_path, model_a, cfg, tokenizer, {"step": 1})
    model_b, _, _ = make_run(seed=1)

    real_save = ckpt_module.save_model

    def half_written(model, filename, metadata=None):
        real_save(model, filename, metadata=metadata)
        with open(filename, "r+b") as f:  # torn file, then the "kill"
            f.truncate(100)
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_module, "save_model", half_written)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, model_b, cfg, tokenizer, {"step": 2})
    loaded = load_checkpoint(tmp_path, with_state=True)
    assert loaded.state["step"] == 1
    assert_same_weights(weights(loaded.model), weights(model_a))
    assert not list(tmp_path.glob(".tmp-*"))  # the failed save cleaned up after itself


def test_full_disk_is_an_os_error_naming_the_folder(tmp_path, monkeypatch):
    """torch.save reports a full disk as a RuntimeError: the save turns it into one OSError
    line naming the checkpoint folder (the command line's error), not a traceback."""
    model, cfg, tokenizer = make_run()
    save_checkpoint(tmp_path, model, cfg, tokenizer, {"step": 1})

    def disk_full(obj, f):
        Path(f).write_bytes(b"PK")  # torn
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 9 vs 2")

    monkeypatch.setattr(ckpt_module.torch, "save", disk_full)
    with pytest.raises(OSError, match=r"cannot write the checkpoint \(\[enforce") as error:
        save_checkpoint(tmp_path, model, cfg, tokenizer, {"step": 2})
    assert str(error.value).startswith(f"{tmp_path}: ")
    # its own files, not the folder's: a run's best/ inside it may have just been replaced
    assert "its checkpoint files are as they were" in str(error.value)
    monkeypatch.undo()
    assert load_checkpoint(tmp_path, with_state=True).state["step"] == 1
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_failed_first_save_leaves_no_folder(tmp_path, monkeypatch):
    """A save that fails into a folder it created removes it (a run's first best/ stayed
    behind empty, read as a broken checkpoint); a folder that was there stays."""
    model, cfg, tokenizer = make_run()

    def disk_full(obj, f):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 9 vs 2")

    monkeypatch.setattr(ckpt_module.torch, "save", disk_full)
    for folder in (tmp_path / "best", tmp_path / "made" / "best"):
        with pytest.raises(OSError, match="cannot write the checkpoint"):
            save_checkpoint(folder, model, cfg, tokenizer, {"step": 1})
        assert not folder.exists()
    with pytest.raises(OSError, match="cannot write the checkpoint"):
        save_checkpoint(tmp_path, model, cfg, tokenizer, {"step": 1})
    assert tmp_path.is_dir() and not list(tmp_path.glob(".tmp-*"))


def test_kill_during_move_loads_new_checkpoint(tmp_path, monkeypatch):
    """Killed after the commit point, half the files moved: readers see the new
    checkpoint whole, and the next save finishes the move."""
    model_a, cfg, tokenizer = make_run(seed=0)
    save_checkpoint(tmp_path, model_a, cfg, tokenizer, {"step": 1})
    model_b, _, _ = make_run(seed=1)

    real_replace = os.replace
    calls = {"n": 0}

    def dies_after_two(src, dst):
        calls["n"] += 1
        # the tokenizer's own atomic write, then config moved; the rest not yet
        if calls["n"] > 2:
            raise KeyboardInterrupt("killed")
        real_replace(src, dst)

    monkeypatch.setattr(ckpt_module.os, "replace", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, model_b, cfg, tokenizer, {"step": 2})
    monkeypatch.setattr(ckpt_module.os, "replace", real_replace)
    assert (tmp_path / ckpt_module.PENDING_DIR).is_dir()
    loaded = load_checkpoint(tmp_path, with_state=True)
    assert loaded.state["step"] == 2
    assert_same_weights(weights(loaded.model), weights(model_b))
    # A stale temp folder from a save killed before its commit is ignored, then removed.
    (tmp_path / ".tmp-stale").mkdir()
    (tmp_path / ".tmp-stale" / "model.safetensors").write_bytes(b"junk")
    assert load_checkpoint(tmp_path, with_state=True).state["step"] == 2
    save_checkpoint(tmp_path, model_a, cfg, tokenizer, {"step": 3})
    assert not (tmp_path / ckpt_module.PENDING_DIR).exists()
    assert not (tmp_path / ".tmp-stale").exists()
    loaded = load_checkpoint(tmp_path, with_state=True)
    assert loaded.state["step"] == 3
    assert_same_weights(weights(loaded.model), weights(model_a))


@pytest.mark.parametrize("with_tokenizer", [True, False])
@pytest.mark.parametrize("moved", range(5))
def test_a_save_killed_anywhere_in_its_move_loads_whole(
    tmp_path, monkeypatch, moved, with_tokenizer
):
    """Killed after its commit point with ``moved`` files out of .pending (all of them and
    .pending not yet removed, from 4 with a tokenizer, 3 without): readers see the new
    checkpoint, its tokenizer included, and finishing the move keeps it. (Once the move had
    taken tokenizer.json out, readers took the .pending folder without it for a save without
    one: "tokenizer.json is missing", and finishing the move deleted it.)"""
    model_a, cfg, tokenizer = make_run(seed=0)
    save_checkpoint(tmp_path, model_a, cfg, tokenizer, {"step": 1})
    model_b, _, _ = make_run(seed=1)
    real_replace, real_rmtree, calls = os.replace, shutil.rmtree, {"n": 0}

    def replace(src, dst):  # a kill after ``moved`` moves out of .pending
        if Path(src).parent.name == ckpt_module.PENDING_DIR:
            if calls["n"] == moved:
                raise KeyboardInterrupt("killed")
            calls["n"] += 1
        real_replace(src, dst)

    def rmtree(path, *args, **kwargs):  # or, all moved, before .pending is removed
        if Path(path).name == ckpt_module.PENDING_DIR:
            raise KeyboardInterrupt("killed")
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(ckpt_module.os, "replace", replace)
    monkeypatch.setattr(ckpt_module.shutil, "rmtree", rmtree)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, model_b, cfg, tokenizer if with_tokenizer else None, {"step": 2})
    monkeypatch.undo()
    assert (tmp_path / ckpt_module.PENDING_DIR).is_dir()
    for _ in range(2):  # as the kill left it, then with the move finished
        loaded = load_checkpoint(tmp_path, with_state=True)
        assert loaded.state["step"] == 2
        assert_same_weights(weights(loaded.model), weights(model_b))
        assert (loaded.tokenizer is not None) == with_tokenizer
        ckpt_module._finish_pending(tmp_path)
    assert not (tmp_path / ckpt_module.PENDING_DIR).exists()
    assert (tmp_path / "tokenizer.json").exists() == with_tokenizer


class _Payload:
    """Unpickling this would create a file: the test checks that never happens."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_trainer_state_is_never_unpickled(tmp_path):
    model, cfg, tokenizer = make_run()
    save_checkpoint(tmp_path, model, cfg, tokenizer, {"step": 1})
    state_file = tmp_path / ckpt_module.STATE_FILE
    state = torch.load(state_file, weights_only=True)
    marker = tmp_path / "pwned"
    state["trainer"]["evil"] = _Payload(marker)
    torch.save(state, state_file)
    with pytest.raises(CheckpointError, match="trainer state"):
        load_checkpoint(tmp_path, with_state=True)
    assert not marker.exists()


def test_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "nope")
    model, cfg, tokenizer = make_run()
    good = tmp_path / "good"
    save_checkpoint(good, model, cfg, tokenizer, {"step": 1})

    def broken(name: str) -> Path:
        d = tmp_path / name
        shutil.copytree(good, d)
        return d

    d = broken("missing")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors is missing"):
        load_checkpoint(d)

    d = broken("torn")
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate(50)
    with pytest.raises(CheckpointError, match="cannot read weights"):
        load_checkpoint(d)

    d = broken("config")
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="invalid run config"):
        load_checkpoint(d)

    d = broken("state")
    (d / "trainer_state.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot read trainer state"):
        load_checkpoint(d)

    # Weights from one save beside the state of another: caught, not silently mixed.
    other = tmp_path / "other"
    save_checkpoint(other, model, cfg, tokenizer, {"step": 2})
    d = broken("mixed")
    shutil.copy(other / "model.safetensors", d / "model.safetensors")
    with pytest.raises(CheckpointError, match="different saves"):
        load_checkpoint(d)


DIGEST_KEYS = ("config_sha256", "tokenizer_sha256")  # the weights metadata's digest keys


def _rewrite_weights_metadata(path: Path, drop: tuple[str, ...] = (), **metadata: str) -> None:
    """Save ``path``'s tensors again, its metadata without ``drop`` and updated by
    ``metadata``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(path, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        stored = {k: v for k, v in f.metadata().items() if k not in drop}
    save_file(tensors, path, metadata={**stored, **metadata})


def test_a_checkpoint_records_its_format_and_attnlab_version(tmp_path):
    from safetensors import safe_open

    import attnlab

    model, cfg, tokenizer = make_run()
    save_checkpoint(tmp_path, model, cfg, tokenizer, {"step": 1})
    state = torch.load(tmp_path / ckpt_module.STATE_FILE, weights_only=True)
    assert state["format_version"] == ckpt_module.FORMAT_VERSION
    assert state["attnlab_version"] == attnlab.__version__
    with safe_open(tmp_path / ckpt_module.WEIGHTS_FILE, "pt") as f:
        meta = f.metadata()
    assert meta["format_version"] == str(ckpt_module.FORMAT_VERSION)
    assert meta["attnlab_version"] == attnlab.__version__


@pytest.mark.parametrize("with_state", [True, False])
def test_a_checkpoint_of_a_newer_format_asks_for_a_newer_attnlab(tmp_path, with_state):
    """A later attnlab's checkpoint format is refused in one line that names the version
    that wrote it and says to upgrade, from the trainer state or, in a weights-only folder,
    from the weights' metadata; a folder from before the weights recorded it still loads."""
    model, cfg, tokenizer = make_run()
    save_checkpoint(tmp_path, model, cfg, tokenizer, {"step": 1})
    newer = ckpt_module.FORMAT_VERSION + 1
    weights_file = tmp_path / ckpt_module.WEIGHTS_FILE
    if with_state:
        state_file = tmp_path / ckpt_module.STATE_FILE
        state = torch.load(state_file, weights_only=True)
        torch.save({**state, "format_version": newer, "attnlab_version": "9.0"}, state_file)
        culprit = ckpt_module.STATE_FILE
    else:
        (tmp_path / ckpt_module.STATE_FILE).unlink()
        _rewrite_weights_metadata(weights_file, format_version=str(newer), attnlab_version="9.0")
        culprit = ckpt_module.WEIGHTS_FILE
    pattern = rf"{culprit}: written by attnlab 9\.0 in checkpoint format {newer}, newer .*upgrade"
    with pytest.raises(CheckpointError, match=pattern) as info:
        load_checkpoint(tmp_path)
    assert "\n" not in str(info.value)
    if not with_state:  # weights written before the format was recorded in them
        _rewrite_weights_metadata(weights_file, drop=("format_version", "attnlab_version"))
        assert_same_weights(weights(load_checkpoint(tmp_path).model), weights(model))


@pytest.mark.parametrize("metadata", [{"format_version": 1}, ["format_version"]])
def test_weights_metadata_that_is_not_text_is_one_clear_error(tmp_path, metadata):
    """The safetensors format's metadata maps text to text; a header breaking that (written
    by hand or by another tool) was an AttributeError traceback from ``str.isdigit``."""
    import json
    import struct

    model, cfg, tokenizer = make_run()
    save_checkpoint(tmp_path, model, cfg, tokenizer)
    weights_file = tmp_path / ckpt_module.WEIGHTS_FILE
    raw = weights_file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = {**json.loads(raw[8 : 8 + n]), "__metadata__": metadata}
    encoded = json.dumps(header).encode()
    weights_file.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + n :])
    pattern = "__metadata__ is not a JSON object of strings"
    with pytest.raises(CheckpointError, match=pattern) as info:
        load_checkpoint(tmp_path)
    assert "\n" not in str(info.value)


def test_an_unknown_trainer_state_format_is_refused(tmp_path):
    model, cfg, tokenizer = make_run()
    save_checkpoint(tmp_path, model, cfg, tokenizer, {"step": 1})
    state_file = tmp_path / ckpt_module.STATE_FILE
    state = torch.load(state_file, weights_only=True)
    torch.save({**state, "format_version": 0}, state_file)
    with pytest.raises(CheckpointError, match=r"format 0 by attnlab .* is not the format 1"):
        load_checkpoint(tmp_path)


def test_weights_load_without_trainer_state(tmp_path):
    """Inference needs config, weights and tokenizer only: a folder whose trainer_state.pt
    was deleted (or never written) loads; only resuming needs the state."""
    from attnlab.training import TrainingError, train

    model, cfg, tokenizer = make_run()
    save_checkpoint(tmp_path, model, cfg, tokenizer, {"step": 3})
    (tmp_path / ckpt_module.STATE_FILE).unlink()
    loaded = load_checkpoint(tmp_path, with_state=True)
    assert loaded.state is None and loaded.config == cfg
    assert loaded.tokenizer.to_json() == tokenizer.to_json()
    assert_same_weights(weights(loaded.model), weights(model))
    # Without a tokenizer.json either: a model without a tokenizer.
    (tmp_path / "tokenizer.json").unlink()
    assert load_checkpoint(tmp_path).tokenizer is None
    with pytest.raises(TrainingError, match=r"no trainer state \(trainer_state.pt.*init-from"):
        train(None, tmp_path, resume=tmp_path, progress=False)


def test_a_save_without_a_tokenizer_removes_an_older_saves(tmp_path):
    """A model without a tokenizer saved over a checkpoint that had one: no stale
    tokenizer.json stays behind, which a folder whose trainer_state.pt is then deleted
    (weights only: the tokenizer is whatever file is there) would load as the model's."""
    model, cfg, tokenizer = make_run()
    save_checkpoint(tmp_path, model, cfg, tokenizer, {"step": 1})
    assert (tmp_path / "tokenizer.json").is_file()
    save_checkpoint(tmp_path, model, cfg, None, {"step": 2})
    assert not (tmp_path / "tokenizer.json").exists()
    assert load_checkpoint(tmp_path, with_state=True).tokenizer is None
    (tmp_path / ckpt_module.STATE_FILE).unlink()
    assert load_checkpoint(tmp_path).tokenizer is None


def test_config_and_weights_that_disagree_name_the_tensors(tmp_path):
    model, cfg, tokenizer = make_run(tie=False)
    save_checkpoint(tmp_path, model, cfg, tokenizer, {"step": 1})
    config_file = tmp_path / "config.json"
    saved = config_file.read_text()
    # A wider model: every shape differs; the message names tensors with both shapes.
    config_file.write_text(cfg.override({"model.d_model": 32}).to_json())
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path)
    message = str(info.value)
    assert "do not match config.json" in message and "wrong shape (" in message
    emb = model.tok_emb.weight.shape
    assert f"tok_emb.weight has shape ({emb[0]}, 16), the config implies ({emb[0]}, 32)" in message
    assert "more)" in message  # the rest counted, not listed
    # A deeper model: the missing layer's tensors, with the shapes the config implies.
    config_file.write_text(cfg.override({"model.n_layers": 2}).to_json())
    with pytest.raises(CheckpointError, match=r"missing \(\d+\): blocks\.1\.\S+ \(\d+,( \d+)?\)"):
        load_checkpoint(tmp_path)
    # A shallower one: the stored layer's tensors are unexpected, with their shapes.
    config_file.write_text(saved)
    deeper = cfg.override({"model.n_layers": 2})
    save_checkpoint(tmp_path, build_model(deeper.model), deeper, tokenizer, {"step": 1})
    config_file.write_text(saved)
    with pytest.raises(
        CheckpointError, match=r"unexpected \(\d+\): blocks\.1\.\S+ \(\d+,( \d+)?\)"
    ):
        load_checkpoint(tmp_path)


def test_an_untied_models_weights_under_a_config_that_ties_them_are_refused(tmp_path):
    """The weights of a model with a head of its own, under a config that ties the head to
    the embedding (a config.json of another run): both tensors are stored, and loading kept
    one of them for both without a word (the model's outputs silently changed)."""
    from safetensors import safe_open

    model, cfg, tokenizer = make_run(tie=False)
    assert not torch.equal(model.lm_head.weight, model.tok_emb.weight)
    save_checkpoint(tmp_path, model, cfg, tokenizer, {"step": 1})
    (tmp_path / "config.json").write_text(cfg.override({"model.tie_embeddings": True}).to_json())
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path)
    message = str(info.value)
    assert "do not match config.json" in message
    assert "stored with different values (1): lm_head.weight and tok_emb.weight" in message
    # Equal values stored under both names (a writer that keeps tied copies, and records
    # no digest of config.json) still load.
    model.lm_head.weight = torch.nn.Parameter(model.tok_emb.weight.detach().clone())
    save_checkpoint(tmp_path, model, cfg, tokenizer, {"step": 1})
    with safe_open(tmp_path / ckpt_module.WEIGHTS_FILE, "pt") as f:  # both stored
        assert {"lm_head.weight", "tok_emb.weight"} <= set(f.keys())
    (tmp_path / "config.json").write_text(cfg.override({"model.tie_embeddings": True}).to_json())
    _rewrite_weights_metadata(tmp_path / ckpt_module.WEIGHTS_FILE, drop=DIGEST_KEYS)
    loaded = load_checkpoint(tmp_path).model
    assert loaded.lm_head.weight is loaded.tok_emb.weight
    torch.testing.assert_close(loaded.tok_emb.weight, model.tok_emb.weight, rtol=0, atol=0)


def test_inference_falls_back_from_a_backend_the_device_cannot_run(tmp_path, monkeypatch):
    """A checkpoint trained with backend triton, loaded on a CPU for inference: flash (the
    kernels' tiled twin) with one warning naming both, not a RuntimeError at the first call;
    a load for training (inference=False) keeps the backend for the trainer to refuse."""
    import attnlab.kernels as kernels

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(kernels, "triton_unavailable_reason", lambda: None)  # as on a GPU box
    model, cfg, tokenizer = make_run()
    cfg.model.attention.backend = "triton"
    save_checkpoint(tmp_path, model, cfg, tokenizer)
    with pytest.warns(UserWarning, match="'triton'.*'flash'") as caught:
        loaded = load_checkpoint(tmp_path, device="cpu")
    assert len(caught) == 1
    assert loaded.config.model.attention.backend == "flash"
    x = torch.randint(0, tokenizer.vocab_size, (2, 9))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x).logits, model(x).logits, atol=1e-5, rtol=1e-5)
    kept = load_checkpoint(tmp_path, device="cpu", inference=False)
    assert kept.config.model.attention.backend == "triton"


def test_backend_fallback_warning_follows_the_callers_filters(tmp_path, monkeypatch):
    """The fallback warning goes through the caller's warning filters ("error" raises it,
    "ignore" hides it; a "once" filter of load_checkpoint's own overrode both) and names
    the caller's line."""
    import warnings

    import attnlab.kernels as kernels

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(kernels, "triton_unavailable_reason", lambda: None)  # as on a GPU box
    model, cfg, tokenizer = make_run()
    cfg.model.attention.backend = "triton"
    save_checkpoint(tmp_path, model, cfg, tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="'triton'.*'flash'"):
            load_checkpoint(tmp_path, device="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore")
        load_checkpoint(tmp_path, device="cpu")
    assert caught == []
    with pytest.warns(UserWarning, match="'triton'.*'flash'") as caught:
        load_checkpoint(tmp_path, device="cpu")
    assert [w.filename for w in caught] == [__file__]


def test_a_training_setting_refused_since_it_was_saved_does_not_stop_inference(tmp_path):
    """A run saved by a version that accepted train.min_lr > train.lr (a plain --set
    train.lr=5e-5 did) still runs its model, with a warning naming the setting; resuming,
    and a model setting that is invalid, are still refused."""
    import json

    model, cfg, tokenizer = make_run()
    save_checkpoint(tmp_path, model, cfg, tokenizer, {"step": 3})
    # as that version saved it: its config.json, and no digests of it in the weights
    _rewrite_weights_metadata(tmp_path / ckpt_module.WEIGHTS_FILE, drop=DIGEST_KEYS)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data["train"].update(lr=5e-5, min_lr=1e-4)
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match=r"train\.min_lr: must be <= train\.lr.*resuming"):
        loaded = load_checkpoint(tmp_path)
    assert loaded.config.train.min_lr == 1e-4 and loaded.config.model == cfg.model
    assert_same_weights(weights(loaded.model), weights(model))
    with pytest.raises(CheckpointError, match=r"invalid run config \(train\.min_lr"):
        load_checkpoint(tmp_path, inference=False)
    data["model"]["d_model"] = -1
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"invalid run config \(model\.d_model"):
        load_checkpoint(tmp_path)


# ------------------------------------------------------- config and tokenizer digests


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _weights_metadata(directory: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(directory / ckpt_module.WEIGHTS_FILE, "pt") as f:
        return f.metadata()


def _another_run(tmp_path: Path, name: str, overrides: dict, tokenizer=None) -> Path:
    """A checkpoint of a run whose config differs from make_run's by ``overrides`` only
    (its tensors have the same names and shapes), saved in ``tmp_path / name``."""
    _, cfg, own_tokenizer = make_run(tie=False)
    cfg = cfg.override(overrides) if overrides else cfg
    torch.manual_seed(1)
    save_checkpoint(tmp_path / name, build_model(cfg.model), cfg, tokenizer or own_tokenizer)
    return tmp_path / name


def test_the_weights_record_the_sha256_of_config_and_tokenizer_as_written(tmp_path):
    """Additive metadata keys (the format version stays): hashlib's SHA-256 of the bytes
    of config.json and tokenizer.json in the folder, "none" for a save without a tokenizer."""
    model, cfg, tokenizer = make_run()
    save_checkpoint(tmp_path / "a", model, cfg, tokenizer, {"step": 1})
    meta = _weights_metadata(tmp_path / "a")
    assert meta["config_sha256"] == _sha256(tmp_path / "a" / "config.json")
    assert meta["tokenizer_sha256"] == _sha256(tmp_path / "a" / "tokenizer.json")
    assert meta["format_version"] == "1" == str(ckpt_module.FORMAT_VERSION)
    save_checkpoint(tmp_path / "b", model, cfg, None)
    assert _weights_metadata(tmp_path / "b")["tokenizer_sha256"] == "none"
    assert _weights_metadata(tmp_path / "b")["config_sha256"] == _sha256(
        tmp_path / "b" / "config.json"
    )


@pytest.mark.parametrize(
    "overrides",
    [
        {"model.dropout": 0.1},
        {"model.position.rope_theta": 500000.0},
        {"model.norm.eps": 1e-6},
        {"train.lr": 3e-4, "train.min_lr": 3e-5},
    ],
    ids=["dropout", "rope_theta", "norm_eps", "training"],
)
def test_a_config_json_of_another_run_with_the_same_shapes_is_refused(tmp_path, overrides):
    """Another run's config.json whose shapes fit the weights loaded without a word (the
    model then computed something else): refused in one line that names the file and says
    to restore it, by load_checkpoint, resuming and the config-only readers."""
    from attnlab.training import train

    model, cfg, tokenizer = make_run(tie=False)
    run = tmp_path / "run"
    save_checkpoint(run, model, cfg, tokenizer, {"step": 1})
    other = _another_run(tmp_path, "other", overrides)
    assert load_checkpoint(other).config != cfg  # the two runs' configs do differ
    shutil.copy(other / "config.json", run / "config.json")
    expected = rf"{run / 'config.json'}: not the config\.json saved with these weights"
    with pytest.raises(CheckpointError, match=expected) as info:
        load_checkpoint(run)
    message = str(info.value)
    assert "\n" not in message
    assert "restore the config.json saved with these weights" in message
    assert "--set train.NAME=VALUE" in message  # how to change a setting without editing
    with pytest.raises(CheckpointError, match=expected):
        train(None, run, resume=run, progress=False)
    with pytest.raises(CheckpointError, match=expected):
        ckpt_module.checked_config_file(run)
    # The file saved with the weights, put back, loads again.
    save_checkpoint(tmp_path / "copy", model, cfg, tokenizer)
    shutil.copy(tmp_path / "copy" / "config.json", run / "config.json")
    assert load_checkpoint(run).config == cfg
    assert ckpt_module.checked_config_file(run) == run / "config.json"


def test_an_edited_config_names_the_evaluation_settings_set_changes(tmp_path):
    """A Transformer-XL config.json edited for a longer memory: refused, and the message
    points to the --set of eval/generate, which changes it without editing the file."""
    from attnlab.models.xl import XLConfig

    tokenizer = train_tokenizer("char", [TEXT])
    model_cfg = XLConfig(
        vocab_size=tokenizer.vocab_size, max_seq_len=16, d_model=16, n_layers=1, mem_len=8
    )
    model_cfg.attention.n_heads = 2
    cfg = RunConfig(model=model_cfg, train=TrainConfig(batch_size=3))
    save_checkpoint(tmp_path, build_model(cfg.model), cfg, tokenizer)
    edited = cfg.override({"model.mem_len": 32})
    (tmp_path / "config.json").write_text(edited.to_json() + "\n")
    with pytest.raises(CheckpointError, match="not the config.json saved") as info:
        load_checkpoint(tmp_path)
    message = str(info.value)
    assert "\n" not in message
    assert "--set model.NAME=VALUE" in message
    assert "model.mem_len, model.clamp_len, model.same_length" in message
    with pytest.raises(CheckpointError) as info:
        ckpt_module.checked_config_file(tmp_path)
    assert str(info.value) == message


@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_a_tokenizer_json_of_another_run_is_refused(tmp_path, kind, with_state):
    """Another run's tokenizer.json of the same size (other characters, or a BPE with
    other merges: the ids mean other text) passed the vocabulary-size check: refused in one
    line naming the file, with the state and in a weights-only folder."""
    _, cfg, _ = make_run(tie=False)
    if kind == "char":
        own = train_tokenizer("char", [TEXT])
        other = train_tokenizer("char", [TEXT.replace("z", "Z")])
    else:
        own = train_tokenizer("bpe", [TEXT * 20], 270)
        other = train_tokenizer("bpe", ["a cat sat on a mat and a bat ate a rat. " * 20], 270)
    assert own.vocab_size == other.vocab_size
    assert own.decode(own.encode("the cat")) == "the cat" != other.decode(own.encode("the cat"))
    cfg = cfg.override({"model.vocab_size": own.vocab_size})
    run = tmp_path / "run"
    save_checkpoint(run, build_model(cfg.model), cfg, own, {"step": 1})
    if not with_state:  # weights only: the tokenizer is whatever file the folder holds
        (run / ckpt_module.STATE_FILE).unlink()
    other.save(tmp_path / "other.json")
    shutil.copy(tmp_path / "other.json", run / "tokenizer.json")
    expected = f"{run / 'tokenizer.json'}: not the tokenizer.json saved with these weights"
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(run)
    message = str(info.value)
    assert message.startswith(expected) and "\n" not in message
    assert "restore the tokenizer.json saved with these weights" in message
    own.save(run / "tokenizer.json")  # the file saved with the weights, put back
    assert load_checkpoint(run).tokenizer.to_json() == own.to_json()


def test_a_checkpoint_without_digests_still_loads(tmp_path):
    """A checkpoint written before the digests were recorded loads as before, unchecked:
    even with a config.json and a tokenizer.json that are not its own."""
    model, cfg, tokenizer = make_run(tie=False)
    save_checkpoint(tmp_path, model, cfg, tokenizer, {"step": 4})
    assert set(DIGEST_KEYS) <= set(_weights_metadata(tmp_path))
    _rewrite_weights_metadata(tmp_path / ckpt_module.WEIGHTS_FILE, drop=DIGEST_KEYS)
    assert not set(DIGEST_KEYS) & set(_weights_metadata(tmp_path))
    loaded = load_checkpoint(tmp_path, with_state=True)
    assert loaded.config == cfg and loaded.state == {"step": 4}
    assert_same_weights(weights(loaded.model), weights(model))
    other = _another_run(tmp_path, "other", {"model.norm.eps": 1e-6})
    shutil.copy(other / "config.json", tmp_path / "config.json")
    assert load_checkpoint(tmp_path).config.model.norm.eps == 1e-6
    assert ckpt_module.checked_config_file(tmp_path) == tmp_path / "config.json"


def test_a_tokenizer_added_to_a_checkpoint_saved_without_one_loads(tmp_path):
    """import-hf of a model without a tokenizer says to copy its tokenizer.json into the
    folder: the weights record "none", so nothing differs (as before the digests)."""
    model, cfg, tokenizer = make_run()
    save_checkpoint(tmp_path, model, cfg, None)
    (tmp_path / ckpt_module.STATE_FILE).unlink()
    assert _weights_metadata(tmp_path)["tokenizer_sha256"] == "none"
    tokenizer.save(tmp_path / "tokenizer.json")
    assert load_checkpoint(tmp_path).tokenizer.to_json() == tokenizer.to_json()


def test_a_run_saves_loads_and_resumes_with_its_digests(tmp_path):
    """The trainer's checkpoints record the digests of the files they write beside the
    weights, so a run loads and resumes (and its resumed save records its new config)."""
    from attnlab.data.lm import prepare_data
    from attnlab.training import train

    (tmp_path / "corpus.txt").write_text(TEXT * 40)
    data = DataConfig(path=str(tmp_path / "corpus.txt"))
    dataset = prepare_data(data, cache_dir=tmp_path / "cache")
    model_cfg = gpt2_style(vocab_size=256, max_seq_len=16, d_model=16, n_layers=1, n_heads=2)
    train_cfg = TrainConfig(batch_size=2, max_steps=2, warmup_steps=1, eval_every=0, log_every=1)
    cfg = RunConfig(model=model_cfg, train=train_cfg, data=data)
    run = tmp_path / "run"
    train(cfg, run, dataset=dataset, progress=False)
    meta = _weights_metadata(run)
    assert meta["config_sha256"] == _sha256(run / "config.json")
    assert meta["tokenizer_sha256"] == _sha256(run / "tokenizer.json")
    assert load_checkpoint(run, with_state=True).state["step"] == 2
    resumed = train(None, run, resume=run, max_steps=3, dataset=dataset, progress=False)
    assert resumed.step == 3
    loaded = load_checkpoint(run, with_state=True)
    assert loaded.state["step"] == 3 and loaded.config.train.max_steps == 3
    assert (
        _weights_metadata(run)["config_sha256"]
        == _sha256(run / "config.json")
        != meta["config_sha256"]
    )


def _cli_argv(command: str, run: Path, tmp_path: Path) -> list[str]:
    return {
        "info": ["info", "--ckpt", str(run)],
        "generate": ["generate", "--ckpt", str(run), "--prompt", "the", "--max-new-tokens", "2"],
        "eval": ["eval", "--ckpt", str(run), "--data", str(tmp_path / "text.txt")],
        "export-hf": ["export-hf", str(run), str(tmp_path / "exported")],
        "train --resume": ["train", "--resume", str(run), "--max-steps", "2", "--quiet"],
        "train --init-from": ["train", "--init-from", str(run), "--out", str(tmp_path / "ft")],
    }[command]


@pytest.mark.parametrize(
    "command", ["info", "generate", "eval", "export-hf", "train --resume", "train --init-from"]
)
def test_every_command_refuses_another_runs_config_in_one_line(tmp_path, command, capsys):
    """Each command that reads a checkpoint folder's config.json refuses another run's, in
    one error line naming it, before any work (nothing written)."""
    import warnings

    from attnlab.cli.main import main

    model, cfg, tokenizer = make_run(tie=False)
    run = tmp_path / "run"
    save_checkpoint(run, model, cfg, tokenizer, {"step": 1})
    (tmp_path / "text.txt").write_text(TEXT * 4)
    other = _another_run(tmp_path, "other", {"model.norm.eps": 1e-6})
    shutil.copy(other / "config.json", run / "config.json")
    hook = warnings.showwarning
    try:
        code = main(_cli_argv(command, run, tmp_path))
    finally:
        warnings.showwarning = hook  # main() replaces it
    err = capsys.readouterr().err.strip()
    assert code not in (0, None)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"{run / 'config.json'}: not the config.json saved with these weights" in err
    assert not (tmp_path / "exported").exists() and not (tmp_path / "ft").exists()


def test_a_tokenizer_added_to_a_save_without_one_is_loaded(tmp_path):
    """import-hf of a model without a tokenizer says to copy its tokenizer.json into the
    folder: the copy is loaded (the trainer state's has_tokenizer=False ignored it). An older
    save's tokenizer.json is still never taken for a save without one: while an interrupted
    save's .pending folder (without a tokenizer) is there, readers skip it, and finishing
    that save removes it."""
    import shutil

    model, cfg, tokenizer = make_run()
    save_checkpoint(tmp_path / "a", model, cfg, None, {"step": 1})
    assert load_checkpoint(tmp_path / "a").tokenizer is None
    tokenizer.save(tmp_path / "a" / "tokenizer.json")
    loaded = load_checkpoint(tmp_path / "a", with_state=True).tokenizer
    assert loaded is not None and loaded.encode("hello") == tokenizer.encode("hello")
    # A save without a tokenizer, killed after its commit, over one that had a tokenizer.
    save_checkpoint(tmp_path / "b", model, cfg, tokenizer, {"step": 1})
    save_checkpoint(tmp_path / "c", model, cfg, None, {"step": 2})
    shutil.copytree(tmp_path / "c", tmp_path / "b" / ckpt_module.PENDING_DIR)
    assert load_checkpoint(tmp_path / "b").tokenizer is None
    (tmp_path / "b" / ckpt_module.STATE_FILE).unlink()  # weights only: still not the old one
    assert load_checkpoint(tmp_path / "b").tokenizer is None
    ckpt_module._finish_pending(tmp_path / "b")
    assert not (tmp_path / "b" / "tokenizer.json").exists()
    assert load_checkpoint(tmp_path / "b", with_state=True).state["step"] == 2
