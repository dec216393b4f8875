"""``attnlab kv``: the published KV-cache figures (Llama-2-70B fp16 327,680 bytes/token,
1.34 GB per 4,096-token sequence, 8x less than with full MHA; DeepSeek-V3 bf16 70,272
bytes/token), the JSON form against the library, and bad input as one error line."""

from __future__ import annotations

import json

import torch

from attnlab.analysis import count_parameters, kv_cache_bytes
from attnlab.cli.main import main
from attnlab.models import build_model
from attnlab.presets import get_preset


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_kv_table_reproduces_published_figures(capsys):
    code, out, _ = _run(["kv", "--preset", "llama-2-70b", "--dtype", "float16"], capsys)
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith("llama-2-70b"))
    assert "327,680" in row and "8.00x" in row and " 1.34 " in row
    code, out, _ = _run(["kv", "--preset", "deepseek-v3", "--json"], capsys)  # bf16 default
    (report,) = json.loads(out)
    assert report["bytes_per_token"] == 70_272


def test_kv_json_matches_the_library(capsys):
    argv = ["kv", "--preset", "deepseek-tiny", "--preset", "llama-tiny", "--json"]
    argv += ["--seq-len", "64", "--seq-len", "100", "--batch", "3", "--dtype", "float8"]
    argv += ["--gpu-gb", "0.001"]
    code, out, _ = _run(argv, capsys)
    assert code == 0
    reports = json.loads(out)
    assert [r["model"] for r in reports] == ["deepseek-tiny", "llama-tiny"]
    for r in reports:
        cfg = get_preset(r["model"])
        for n in (64, 100):
            assert r["bytes"][str(n)] == kv_cache_bytes(cfg, n, 3, torch.float8_e4m3fn)
            free = 1e6 - count_parameters(cfg)["total"]  # float8 weights: 1 byte each
            assert r["fit"][str(n)] == int(free // r["bytes"][str(n)])
    assert reports[0]["mha_ratio"] == 4 * (24 + 16) / (32 + 8)  # h (d_qk + d_v) / (d_c + d_r)


def test_kv_defaults_and_the_table_show_the_json(capsys):
    """Defaults: bfloat16, one sequence of 4096 tokens, an 80 GB GPU; weights that do not
    fit leave room for no cache; the table's columns are the JSON's numbers."""
    argv = ["kv", "--preset", "llama-2-7b", "--preset", "deepseek-v3"]
    code, out, _ = _run([*argv, "--json"], capsys)
    assert code == 0
    small, big = json.loads(out)
    for r in (small, big):
        assert (r["dtype"], r["batch"], r["gpu_gb"], list(r["bytes"])) == (
            "bfloat16", 1, 80.0, ["4096"]
        )  # fmt: skip
        assert r["bytes"]["4096"] == kv_cache_bytes(get_preset(r["model"]), 4096, 1, torch.bfloat16)
    assert small["fit"]["4096"] == int((80e9 - small["weights_bytes"]) // small["bytes"]["4096"])
    assert big["weights_bytes"] > 80e9 and big["fit"]["4096"] == 0  # 671B parameters
    code, out, _ = _run(argv, capsys)
    assert code == 0
    for r in (small, big):
        row = next(line for line in out.splitlines() if line.startswith(r["model"]))
        gb, fit = f"{r['bytes']['4096'] / 1e9:.3g}", f"{r['fit']['4096']:,}"
        assert row.split()[2:] == [f"{r['bytes_per_token']:,}", f"{r['mha_ratio']:.2f}x", gb, fit]
    code, _, err = _run(["kv", "--preset", "llama-tiny", "--set", "train.lr=1"], capsys)
    assert code == 1 and err == "attnlab: error: --set train.lr: kv only uses model.* fields\n"


def test_kv_big_caches_in_whole_gb_and_lengths_past_max_seq_len_noted(capsys):
    """1,000 GB and more print as whole GB with separators (they were '2.1e+04'); a length
    past a model's max_seq_len is noted below the table (gpt2's learned positions cannot
    go there) and the JSON gives max_seq_len."""
    argv = ["kv", "--preset", "gpt2", "--preset", "llama-2-70b", "--batch", "64"]
    argv += ["--seq-len", "512", "--seq-len", "4096", "--seq-len", "1000000"]
    code, out, _ = _run([*argv, "--json"], capsys)
    assert code == 0
    reports = json.loads(out)
    assert [r["max_seq_len"] for r in reports] == [1024, 4096]
    code, out, _ = _run(argv, capsys)
    assert code == 0
    lines = out.splitlines()
    for r in reports:
        row = next(line for line in lines if line.startswith(r["model"])).split()
        big = r["bytes"]["1000000"] / 1e9
        assert (
            big >= 1000
            and row[6] == f"{round(big):,}"
            and row[4] == f"{r['bytes']['512'] / 1e9:.3g}"
        )
    assert lines[-2:] == [
        "note: gpt2 at 4,096 and 1,000,000 tokens: past its max_seq_len (1,024)",
        "note: llama-2-70b at 1,000,000 tokens: past its max_seq_len (4,096)",
    ]


def test_kv_fit_counts_the_moe_routers_kept_in_float32(capsys):
    argv = ["kv", "--preset", "deepseek-moe-tiny", "--json", "--gpu-gb", "0.001"]
    code, out, _ = _run(argv, capsys)  # bf16 default
    assert code == 0
    (report,) = json.loads(out)
    model = build_model(get_preset("deepseek-moe-tiny")).to(torch.bfloat16)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert report["weights_bytes"] == weights
    assert report["fit"]["4096"] == int((1e6 - weights) // report["bytes"]["4096"])


def test_kv_bad_input_is_one_error_line(capsys):
    code, _, err = _run(["kv", "--preset", "no-such-model"], capsys)
    assert code == 1 and err.count("\n") == 1 and "unknown preset" in err
    code, _, err = _run(["kv", "--preset", "gpt2-tiny", "--seq-len", "0"], capsys)
    assert code == 2


def test_info_and_kv_on_models_without_a_kv_formula(capsys):
    """An encoder has parameters but no decoding cache or decoder FLOP formula: info says
    so (and JSON has nulls), kv refuses in one line; linear attention caches nothing per
    token; an infinite GPU is no GPU size."""
    code, out, _ = _run(["info", "--preset", "bert-tiny-mlm"], capsys)
    assert code == 0 and "FLOPs, KV     - (the formulas describe decoder-only" in out
    code, out, _ = _run(["info", "--preset", "bert-tiny-mlm", "--json"], capsys)
    report = json.loads(out)
    assert report["flops_per_token"] is None and report["kv_cache_bytes"] is None
    assert report["parameters"] == count_parameters(get_preset("bert-tiny-mlm"))
    code, _, err = _run(["kv", "--preset", "bert-tiny-mlm"], capsys)
    assert code != 0 and len(err.strip().splitlines()) == 1 and "decoder-only" in err
    argv = ["kv", "--preset", "llama-tiny", "--set", "model.attention.kind=linear", "--json"]
    code, out, _ = _run(argv, capsys)
    (report,) = json.loads(out)
    assert code == 0 and report["bytes_per_token"] == 0 and report["mha_ratio"] is None
    code, _, err = _run(["kv", "--preset", "llama-tiny", "--gpu-gb", "inf"], capsys)
    assert code != 0 and "finite number > 0" in err
