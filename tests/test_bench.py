"""Smoke tests of ``python -m qkvfuse bench`` on tiny configurations: it runs, prints, writes; no timing asserts."""

import dataclasses
import json
import math

import pytest

import qkvfuse.benchmarks as benchmarks
from qkvfuse.benchmarks.harness import COPY, CPU, CPU_RAW, EAGER, Row
from qkvfuse.benchmarks.report import summarize
from qkvfuse.benchmarks.timing import Budget, Candidate, measure
from qkvfuse.cli import main

TINY = ["bench", "--preset", "Qwen3-8B", "--tokens", "1", "--dtype", "bf16", "--hidden", "256", "--no-compile",
        "--seconds", "0.05"]


def test_bench_prints_table_and_writes_json_and_png(tmp_path, capsys):
    json_path, png_path = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(TINY + ["--json", str(json_path), "--plot", str(png_path)]) == 0
    text = capsys.readouterr().out
    assert "machine:" in text and "threads" in text
    assert "== split_qkv_rmsnorm_rope: Qwen3-8B" in text and "== add_rmsnorm: hidden 256" in text
    assert "summary against issue 3's targets" in text
    assert text.rstrip().splitlines()[-1].startswith("bench:")

    payload = json.loads(json_path.read_text())
    rows = payload["rows"]
    assert payload["machine"]["torch_threads"] >= 1 and payload["config"]["tokens"] == [1]
    assert "others_cpu_share" in payload["machine"] and all("others" in r for r in rows)
    placements = {(r["op"], r["data"].split()[0]) for r in rows}
    assert placements == {(op, d) for op in ("split_qkv_rmsnorm_rope", "add_rmsnorm") for d in ("hot", "rotated")}
    for r in rows:
        assert math.isfinite(r["us"]) and r["us"] > 0 and r["roofline"] > 0 and r["rounds"] >= 3
        assert r["check"] == ("ok" if r["impl"] in (CPU, CPU_RAW) else "")  # the timed kernel met the accuracy rule
    # every placement has its own roofline row, measured in the same rounds as the kernels
    assert sum(r["impl"] == COPY for r in rows) == len(placements)
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unavailable_cpu_backend_is_reported_and_its_column_skipped(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(benchmarks, "cpu_unavailable_reason", lambda: "no C++ compiler (test)")
    json_path = tmp_path / "bench.json"
    assert main(TINY + ["--op", "norm", "--json", str(json_path)]) == 0
    text = capsys.readouterr().out
    assert "unavailable, column skipped (no C++ compiler (test))" in text
    payload = json.loads(json_path.read_text())
    assert payload["rows"] and not [r for r in payload["rows"] if r["impl"] == CPU]
    assert payload["config"]["cpu_backend_unavailable"] == "no C++ compiler (test)"


def test_unknown_preset_is_an_error_naming_the_known_ones(capsys):
    assert main(["bench", "--preset", "Qwen9-1T"]) == 2
    assert "known presets" in capsys.readouterr().out


def test_measure_rotates_over_every_buffer_set_in_every_block():
    counts = {"a": [0, 0, 0], "b": [0, 0, 0], "copy": [0, 0, 0]}

    def counter(name, i):
        def call():
            counts[name][i] += 1
        return call

    cands = [Candidate(name, "out=", [counter(name, i) for i in range(3)]) for name in ("a", "b")]
    budget = Budget(block_s=1e-5, cell_s=1e-4, warm_s=1e-5, min_rounds=3, max_rounds=4)
    results = measure(cands, [counter("copy", i) for i in range(3)], budget)
    assert set(results) == {"a [out=]", "b [out=]"}
    for m in results.values():
        assert 3 <= m.rounds <= 4 and m.calls_per_block >= 3 and set(m.vs) <= {"a [out=]", "b [out=]"}
    for per_set in counts.values():
        assert min(per_set) >= 1 + 3  # the warm-up pass plus at least one visit per round


@pytest.mark.slow
def test_bench_with_torch_compile(tmp_path, capsys):
    argv = [a for a in TINY if a != "--no-compile"] + ["--op", "norm", "--json", str(tmp_path / "b.json")]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    compiled = [r for r in rows if r["impl"] == "torch.compile unfused"]
    assert compiled and all(r["compile_s"] > 0 and r["vs_compile"] == 1.0 for r in compiled)


def _row(T, data, impl, us, roofline, op="split_qkv_rmsnorm_rope", shape="Qwen3-8B", outputs="out=", check="ok"):
    return Row(op=op, shape=shape, mode="", dtype="bf16", T=T, data=data, impl=impl, outputs=outputs, us=us, gbps=1.0,
               roofline=roofline, vs_eager=None, vs_compile=None, copy_us=us * roofline, bytes=1, rounds=3,
               calls_per_block=1, check=check if impl == CPU else "")


def test_summary_applies_the_issue_targets_to_cpu_out_rows():
    rows = [_row(1, "hot", CPU, 3.0, 0.3), _row(1, "rotated x80", CPU, 6.0, 0.2),  # rotated is judged: missed
            _row(16, "hot", CPU, 5.0, 0.5), _row(16, "rotated x8", CPU, 9.0, 0.34),  # 2.9x copy: met
            _row(256, "1 set", CPU, 90.0, 0.39), _row(256, "1 set", EAGER, 900.0, 0.04),  # 39% < 40%: missed
            _row(4096, "1 set", CPU, 3000.0, 0.72), _row(4096, "1 set", CPU, 9000.0, 0.2, outputs="fresh"),
            _row(4096, "1 set", CPU, 1000.0, 0.69, op="add_rmsnorm", shape="hidden 4096")]
    verdicts = {(s["target"].split()[0], s["target"].split()[1]): s["verdict"] for s in summarize(rows, "")}
    assert verdicts == {("split", "T=1"): "MISSED", ("split", "T=16"): "MET", ("split", "T=256"): "MISSED",
                        ("split", "T=4096"): "MET", ("add_rmsnorm", "T=4096"): "MISSED"}
    noisy = summarize([dataclasses.replace(_row(4096, "1 set", CPU, 1.0, 0.99), others=0.5)], "")
    assert [s["verdict"] for s in noisy] == ["MET (noisy: others 50%)"]
    wrong = summarize([_row(4096, "1 set", CPU, 1.0, 0.99, check="FAIL: q: NaN")], "")
    assert [s["verdict"] for s in wrong] == ["WRONG RESULTS"]  # fast and wrong meets no target
    unavailable = summarize([r for r in rows if r.impl != CPU] + [_row(4096, "1 set", EAGER, 1.0, 0.1)], "no compiler")
    assert [(s["target"].split()[1], s["verdict"]) for s in unavailable] == [
        ("T=256", "n/a: cpu backend unavailable"), ("T=4096", "n/a: cpu backend unavailable")]


@pytest.mark.parametrize("mutation", ["unwritten", "wrong"])
def test_cell_check_catches_a_wrong_kernel(monkeypatch, mutation):
    import torch

    import qkvfuse
    from qkvfuse.benchmarks import harness
    from qkvfuse._verify import SplitCase, make_split_inputs

    def broken(*args, out, backend, **kw):
        q, k, v = qkvfuse.split_qkv_rmsnorm_rope(*args, out=out, backend="reference", **kw)
        if mutation == "unwritten":
            k[1:2].fill_(float("nan"))  # a row the sample would not even look at
        else:
            q[-1, 5] += 0.5  # the last row is always sampled
        return q, k, v

    case = SplitCase.from_preset(qkvfuse.get_preset("Qwen3-8B"), 100, dtype=torch.bfloat16)
    kw = make_split_inputs(case)
    out = tuple(torch.empty(100, n * 128, dtype=torch.bfloat16) for n in (32, 8, 8))
    if not benchmarks.cpu_unavailable_reason():
        assert harness._check_split(kw, out) == "ok"  # the real kernel passes
    monkeypatch.setattr(harness, "split_qkv_rmsnorm_rope", broken)
    assert harness._check_split(kw, out).startswith("FAIL")
