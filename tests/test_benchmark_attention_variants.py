"""benchmarks/attention_variants.py reports what docs/benchmarks.md says its table holds:
the cache bytes each token adds, and for linear attention its whole recurrent state."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from attnlab.analysis import kv_cache_bytes, kv_cache_bytes_per_token
from attnlab.models import build_model

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_kv_column_is_linear_attentions_whole_state(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("attention_variants")
    variants = bench.variants()
    linear = bench.config(variants["linear"], 103)
    state = build_model(linear).new_cache(1, 1).nbytes  # what decoding keeps, at any length
    assert bench.cache_bytes_per_token(linear) == state == kv_cache_bytes(linear, 1) > 0
    mha = bench.config(variants["MHA"], 103)
    assert bench.cache_bytes_per_token(mha) == kv_cache_bytes_per_token(mha) == 4096


def test_only_refuses_a_name_that_is_no_variant(monkeypatch, capsys):
    """``--only mha`` (the table says "MHA") was accepted, trained nothing and ended in an
    IndexError on the empty table after loading the corpus; now argparse refuses it first."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("attention_variants")

    def no_data(*args, **kwargs):
        raise AssertionError("the corpus was loaded before --only was checked")

    monkeypatch.setattr(bench, "prepare_data", no_data)
    monkeypatch.setattr("sys.argv", ["attention_variants.py", "--only", "MHA", "mha"])
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--only: no variant 'mha'" in err
    assert all(repr(name) in err for name in bench.variants())
