"""Smoke tests of ``python -m qkvfuse bench`` on tiny configurations: it runs, prints, writes; no timing asserts.

Speed lives in the benchmark, never here: these tests check that every section runs at tiny sizes, that every
timed row's result was verified (and that a wrong result is caught), and the verdict logic on made-up rows.
"""

import dataclasses
import json
import math

import pytest
import torch

import qkvfuse.benchmarks as benchmarks
from qkvfuse.benchmarks.harness import BARE, COPY, CPU, EAGER, BenchConfig, Row
from qkvfuse.benchmarks.report import summarize
from qkvfuse.benchmarks.timing import Budget, Candidate, measure, restorer
from qkvfuse.cli import main
from qkvfuse_bench import targets

TINY = ["bench", "--preset", "Qwen3-8B", "--tokens", "1", "--dtype", "bf16", "--hidden", "256", "--no-compile",
        "--seconds", "0.05"]


def test_bench_prints_table_and_writes_json_and_png(tmp_path, capsys):
    json_path, png_path = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(TINY + ["--json", str(json_path), "--plot", str(png_path)]) == 0
    text = capsys.readouterr().out
    assert "machine:" in text and "threads" in text
    assert "== split_qkv_rmsnorm_rope: Qwen3-8B" in text and "== add_rmsnorm: hidden 256" in text
    # the user's bench prints measurements only: the team's targets are the maintainers' command's
    assert "== summary ==" in text and "MET" not in text and "MISSED" not in text and "target" not in text
    assert text.rstrip().splitlines()[-1].startswith("bench:")

    payload = json.loads(json_path.read_text())
    rows = payload["rows"]
    assert payload["machine"]["torch_threads"] >= 1 and payload["config"]["tokens"] == [1]
    assert "others_cpu_share" in payload["machine"] and all("others" in r for r in rows)
    placements = {(r["op"], r["data"].split()[0]) for r in rows}
    assert placements == {(op, d) for op in ("split_qkv_rmsnorm_rope", "add_rmsnorm") for d in ("hot", "rotated")}
    for r in rows:
        assert math.isfinite(r["us"]) and r["us"] > 0 and r["roofline"] > 0 and r["rounds"] >= 3
        assert r["check"] == ("ok" if r["impl"] in (CPU, BARE) else "")  # the timed kernel met the accuracy rule
        assert (r["vs_bare"] is not None) == (r["impl"] != COPY)  # measured in the same rounds as the bare call
    assert {r["vs_bare"] for r in rows if r["impl"] == BARE} == {1.0}
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


def test_measure_restores_an_in_place_candidates_inputs_before_each_block():
    # An in-place candidate's inputs see one block's calls at most (timing.fixed_point_weights says why).
    buf, seen = torch.zeros(1), []

    def call():
        seen.append(int(buf.item()))
        buf.add_(1)

    cand = Candidate("in place", "in place", [call], reset=restorer([buf]))
    budget = Budget(block_s=1e-5, cell_s=1e-4, warm_s=1e-5, min_rounds=3, max_rounds=4)
    m = measure([cand, Candidate("other", "out=", [lambda: None])], [lambda: None], budget)[cand.key]
    assert seen[:1] == [0] and len(seen) > m.rounds * m.calls_per_block
    assert seen[-m.rounds * m.calls_per_block:] == list(range(m.calls_per_block)) * m.rounds


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


def test_summary_applies_the_speed_targets_to_cpu_out_rows():
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
        assert harness.check_split(kw, out) == "ok"  # the real kernel passes
    monkeypatch.setattr(harness, "split_qkv_rmsnorm_rope", broken)
    assert harness.check_split(kw, out).startswith("FAIL")


# --------------------------------------------------------------------------------------------------------
# The public op against the bare torch.ops call (T >= 16), the per-call section, end to end.
# --------------------------------------------------------------------------------------------------------
needs_cpu = pytest.mark.skipif(bool(benchmarks.cpu_unavailable_reason()), reason="the native cpu backend is needed")


def test_overhead_target_judges_the_worst_cell_at_t16_and_above():
    rows = [dataclasses.replace(_row(T, "1 set", CPU, 10.0, 0.5), vs_bare=ratio)
            for T, ratio in ((1, 3.0), (16, 1.02), (256, 1.04), (4096, 1.01))]  # T = 1 is not judged
    overhead = [s for s in summarize(rows, "") if "bare torch.ops" in s["target"]]
    assert [(s["verdict"], s["measured"].split()[1]) for s in overhead] == [("MET", "1.040x")]
    rows.append(dataclasses.replace(_row(16, "hot", CPU, 10.0, 0.5, shape="GLM-4.7"), vs_bare=1.06))
    verdicts = {s["shape"]: s["verdict"] for s in summarize(rows, "") if "bare torch.ops" in s["target"]}
    assert verdicts == {"Qwen3-8B": "MET", "GLM-4.7": "MISSED"}


@needs_cpu
def test_t16_cells_time_the_bare_op_and_print_the_overhead_verdict(tmp_path, capsys):
    json_path = tmp_path / "bench.json"
    assert targets.main(["--preset", "GLM-4.7", "--tokens", "16", "--dtype", "bf16", "--op", "split",
                         "--no-compile", "--seconds", "0.02", "--json", str(json_path)]) == 0
    text = capsys.readouterr().out
    assert "split T>=16: public op <= 1.05x bare torch.ops" in text and "per-call cost" not in text
    payload = json.loads(json_path.read_text())
    bare = [r for r in payload["rows"] if r["impl"] == BARE]
    assert bare and all(r["check"] == "ok" and r["outputs"] == "out=" for r in bare)
    assert payload["percall"]["rows"] == []
    target = [s for s in payload["summary"] if "bare torch.ops" in s["target"]]
    assert len(target) == 1 and target[0]["verdict"].split()[0] in ("MET", "MISSED")


@needs_cpu
def test_percall_harness_times_the_given_preset_and_hidden_size(tmp_path, capsys):
    from qkvfuse_bench import percall

    assert main(TINY + ["--op", "percall"]) == 2  # the package says where the per-call harness lives
    assert "PYTHONPATH=bench python -m qkvfuse_bench.percall" in capsys.readouterr().err
    json_path = tmp_path / "percall.json"
    assert percall.main(TINY[1:] + ["--json", str(json_path)]) == 0
    text = capsys.readouterr().out
    payload = json.loads(json_path.read_text())
    # the per-call section (T = 1) for the given preset and hidden size
    percall = payload["percall"]["rows"]
    assert {(r["op"], r["shape"]) for r in percall} == {("split_qkv_rmsnorm_rope", "Qwen3-8B"),
                                                        ("add_rmsnorm", "hidden 256")}
    assert "== per-call cost: split_qkv_rmsnorm_rope: Qwen3-8B" in text


@needs_cpu
def test_percall_section_alone(tmp_path, capsys):
    json_path = tmp_path / "bench.json"
    assert targets.main(["--op", "percall", "--preset", "GLM-4.7", "--hidden", "256", "--seconds", "0.02",
                         "--json", str(json_path)]) == 0
    text = capsys.readouterr().out
    for mode in ("default", "inference_mode"):
        assert f"== per-call cost: split_qkv_rmsnorm_rope: GLM-4.7, bf16, T=1, {mode}" in text
        assert f"== per-call cost: add_rmsnorm: hidden 256, bf16, T=1, {mode}" in text
    assert "== per-call targets (bound and functional vs bare" in text and "== speed targets" not in text
    payload = json.loads(json_path.read_text())
    assert payload["rows"] == []
    rows = payload["percall"]["rows"]
    split = [r for r in rows if r["op"] == "split_qkv_rmsnorm_rope"]
    assert {(r["impl"].split()[0], r["form"]) for r in split} == {
        ("QKNormRope", "out="), ("QKNormRope", "in-place"), ("split_qkv_rmsnorm_rope", "out="),
        ("split_qkv_rmsnorm_rope", "in-place"), ("torch.ops", "out="), ("torch.ops", "in-place"), ("copy_", "out=")}
    assert {r["data"].split()[0] for r in rows} == {"hot", "rotated"}
    assert {r["mode"] for r in rows} == {"default", "inference_mode"}
    for r in rows:
        assert math.isfinite(r["us"]) and r["us"] > 0 and r["rounds"] >= 3
        if r["impl"].startswith("copy_"):
            assert r["check"] == "" and r["minus_bare_us"] is None
        else:  # every candidate's own result was verified before it was timed
            assert r["check"] == "ok" and math.isfinite(r["minus_bare_us"])
        if "(bare)" in r["impl"]:
            assert r["minus_bare_us"] == 0.0 and r["vs_bare"] == 1.0
    summary = payload["percall"]["summary"]
    assert {(s["target"].split()[0], s["target"].split()[1]) for s in summary} == {
        ("QKNormRope", "out="), ("QKNormRope", "in-place"), ("AddRMSNorm", "out="), ("AddRMSNorm", "in-place"),
        ("split_qkv_rmsnorm_rope", "out="), ("split_qkv_rmsnorm_rope", "in-place"), ("add_rmsnorm", "out="),
        ("add_rmsnorm", "in-place")}
    assert len(summary) == 8 * 2 * 2 and all(s["verdict"].split()[0] in ("MET", "MISSED") for s in summary)
    assert {s["mode"] for s in summary} == {"default", "inference_mode"}


def test_percall_modes_make_and_call_in_the_mode():
    """The per-call rows' modes: inference_mode makes the tensors and the calls under torch.inference_mode()
    (inference tensors, as vLLM's runner has them), default outside it; a mode of neither is an error."""
    from qkvfuse_bench import percall

    seen = {}

    def rows_of():
        seen["inference"] = torch.is_inference_mode_enabled()
        seen["tensor"] = torch.ones(1).is_inference()
        return [percall.CallRow("op", "s", "bf16", 1, "hot", "impl", "out=", 1.0, None, None, None, 3, 1)]

    for mode in percall.MODES:
        (row,) = percall._in_mode(rows_of, mode)
        assert row.mode == mode and seen == {"inference": mode == "inference_mode", "tensor": mode == "inference_mode"}
    with pytest.raises(ValueError, match="mode: expected one of"):
        percall._in_mode(rows_of, "no_grad")


def _tiny_cfg():
    return BenchConfig(presets=(), hidden_sizes=(), dtypes=(), tokens=(), impls=(), compile_cells=None,
                       budget=Budget(block_s=1e-5, cell_s=1e-4, warm_s=1e-5, min_rounds=3, max_rounds=3),
                       l2_bytes=1 << 14, cpu_reason="")


@needs_cpu
@pytest.mark.parametrize("broken", ["split_qkv_rmsnorm_rope_", "bare_split_call", "AddRMSNorm"])
def test_percall_checks_each_candidate_on_its_own(monkeypatch, broken):
    """A wrong result from one candidate fails that row only: each row's own output is verified."""
    import torch

    import qkvfuse
    from qkvfuse_bench import percall

    if broken == "split_qkv_rmsnorm_rope_":
        def wrong(*args, **kwargs):
            q, k, v = qkvfuse.split_qkv_rmsnorm_rope_(*args, **kwargs)
            q[0, 3] += 1.0
            return q, k, v
        monkeypatch.setattr(percall, broken, wrong)
    elif broken == "bare_split_call":
        real = percall.bare_split_call

        def wrong_bare(kw, out, inplace=False):
            call = real(kw, out, inplace=inplace)
            if inplace:
                return call

            def unwritten():
                call()
                out[1][0, 7] = float("nan")
            return unwritten
        monkeypatch.setattr(percall, broken, wrong_bare)
    else:
        class WrongNorm(qkvfuse.AddRMSNorm):
            __slots__ = ()

            def __call__(self, x, residual=None, *, out=None):
                y, r = super().__call__(x, residual, out=out)
                y.mul_(1.01)
                return y, r
        monkeypatch.setattr(percall, broken, WrongNorm)
    cfg = _tiny_cfg()
    rows = (percall.percall_norm(cfg, 256) if broken == "AddRMSNorm"
            else percall.percall_split(cfg, qkvfuse.get_preset("Qwen3-8B")))
    failed = {(r.impl, r.form) for r in rows if r.check.startswith("FAIL")}
    expected = {"split_qkv_rmsnorm_rope_": {(percall.FUNCTIONAL_SPLIT, "in-place")},
                "bare_split_call": {(percall.BARE_SPLIT, "out=")},
                "AddRMSNorm": {(percall.BOUND_NORM, "out=")}}[broken]
    assert failed == expected
    assert all(r.check == "ok" for r in rows if (r.impl, r.form) not in expected and not r.impl.startswith("copy_"))
    assert torch.isfinite(torch.tensor([r.us for r in rows])).all()


_E2E_TINY = (("hidden_size", 64), ("num_attention_heads", 4), ("num_key_value_heads", 1),
             ("intermediate_size", 128), ("moe_intermediate_size", 32), ("max_position_embeddings", 1024))


def _e2e_cfg(models=("Qwen3-8B", "GLM-4.7"), **changes):
    from qkvfuse_bench.e2e import E2EConfig

    changes.setdefault("config_changes", tuple(kv for kv in _E2E_TINY if models != ("Qwen3-8B",)
                                               or kv[0] != "moe_intermediate_size"))
    return E2EConfig(models=models, context=8, prefill=12, experts=4, decode_steps=2, decode_rounds=3,
                     prefill_rounds=2, profile_steps=2,
                     attribution_budget=Budget(block_s=1e-5, cell_s=1e-4, warm_s=1e-5, min_rounds=3, max_rounds=3),
                     **changes)


def test_e2e_models_keep_the_published_layer_geometry():
    from qkvfuse_bench.e2e import E2EConfig, e2e_transformers_config

    qwen, text = e2e_transformers_config("Qwen3-8B", E2EConfig())
    assert (qwen.hidden_size, qwen.num_attention_heads, qwen.num_key_value_heads, qwen.head_dim,
            qwen.intermediate_size, qwen.num_hidden_layers, qwen.vocab_size) == (4096, 32, 8, 128, 12288, 2, 1024)
    assert qwen.rope_parameters["rope_theta"] == 1e6 and qwen.rope_parameters["partial_rotary_factor"] == 1.0
    assert "vocab 1024" in text and "SHRUNK" not in text
    glm, text = e2e_transformers_config("GLM-4.7", E2EConfig())
    assert (glm.hidden_size, glm.num_attention_heads, glm.num_key_value_heads, glm.head_dim) == (5120, 96, 8, 128)
    assert glm.rope_parameters["partial_rotary_factor"] == 0.5 and glm.use_qk_norm and glm.attention_bias
    assert (glm.n_routed_experts, glm.num_experts_per_tok, glm.moe_intermediate_size, glm.n_shared_experts,
            glm.first_k_dense_replace) == (16, 8, 1536, 1, 0)
    assert "16 routed experts (published 160)" in text
    with pytest.raises(ValueError, match="not supported"):
        e2e_transformers_config("Qwen3-VL-8B", E2EConfig())


@needs_cpu
def test_e2e_smoke_rows_are_checked_and_attributed():
    from qkvfuse_bench.e2e import print_e2e, run_e2e

    cfg = _e2e_cfg()
    results = run_e2e(cfg, log=lambda line: None)
    assert [r["model"] for r in results] == ["Qwen3-8B", "GLM-4.7"]
    for res in results:
        assert "SHRUNK" in res["description"]
        assert [(r["phase"].split()[0], r["mode"]) for r in res["timing"]] == [("decode", "eager"),
                                                                               ("prefill", "eager")]
        for r in res["timing"]:
            assert r["pass"] and r["check"] == "ok" and r["logit err"] <= 0.05
            assert r["unpatched ms"] > 0 and r["patched ms"] > 0 and r["rounds"] >= 2
        assert [(a["phase"], a["variant"]) for a in res["attribution"]] == [
            ("decode", "unpatched"), ("decode", "patched"), ("prefill", "unpatched"), ("prefill", "patched")]
        for a in res["attribution"]:
            assert 0 < a["share"] < 1 and 0 < a["prof share"] < 1
            assert a["prepare ms"] > 0 and a["add-norm ms"] > 0 and a["prof prepare ms"] > 0
            assert a["prof add-norm ms"] > 0  # the unfused residual add and norm were found under the profiler
    assert print_e2e(results, cfg) == 0


@needs_cpu
def test_e2e_check_catches_a_wrong_patched_model(monkeypatch):
    import torch

    from qkvfuse import ops
    from qkvfuse_bench.e2e import print_e2e, run_e2e

    real = ops.AddRMSNorm.__call__

    def wrong(self, x, residual=None, *, out=None):  # the patched layers call their bound AddRMSNorm
        y, residual = real(self, x, residual, out=out)
        g = torch.Generator().manual_seed(0)
        return y, residual + torch.randn(residual.shape, generator=g).to(residual.dtype) * residual.abs().max()
    monkeypatch.setattr(ops.AddRMSNorm, "__call__", wrong)
    cfg = _e2e_cfg(models=("Qwen3-8B",))
    results = run_e2e(cfg, log=lambda line: None)
    assert all(r["check"].startswith("FAIL") for r in results[0]["timing"])
    assert print_e2e(results, cfg) == 2


@needs_cpu
def test_e2e_cli(monkeypatch, tmp_path, capsys):
    from qkvfuse_bench import e2e

    assert e2e.main(["--preset", "Qwen3-VL-8B"]) == 2
    assert "not supported" in capsys.readouterr().out
    monkeypatch.setattr(e2e, "config_from_args", lambda args: _e2e_cfg(models=("Qwen3-8B",)))
    json_path = tmp_path / "e2e.json"
    assert e2e.main(["--json", str(json_path)]) == 0
    text = capsys.readouterr().out
    assert "== end to end: Qwen3-8B geometry, batch 1" in text and "share of a step" in text
    assert text.rstrip().splitlines()[-1].startswith("bench --e2e: 0 failed rows")
    payload = json.loads(json_path.read_text())
    assert payload["results"][0]["timing"][0]["check"] == "ok" and "machine" in payload


def test_bench_e2e_says_where_the_harness_lives(capsys):
    assert main(["bench", "--e2e"]) == 2
    assert "PYTHONPATH=bench python -m qkvfuse_bench.e2e" in capsys.readouterr().err


def test_the_package_never_imports_the_harnesses_outside_it():
    """bench/qkvfuse_bench builds on qkvfuse.benchmarks, never the other way: the installed package has no bench/."""
    import ast
    from pathlib import Path

    src = Path(benchmarks.__file__).resolve().parents[1]
    found = []
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(src)}: {n}" for n in names if n.split(".")[0] == "qkvfuse_bench"]
    assert found == []


@needs_cpu
@pytest.mark.slow
def test_e2e_with_torch_compile():
    from qkvfuse_bench.e2e import run_e2e

    results = run_e2e(_e2e_cfg(models=("Qwen3-8B",), compile=True), log=lambda line: None)
    compiled = [r for r in results[0]["timing"] if r["mode"] == "torch.compile"]
    assert len(compiled) == 2 and all(r["check"] == "ok" and "compile s" in r for r in compiled)


@pytest.mark.parametrize("part", ["latency", "profile", "all"])
def test_vllm_bench_refuses_avx2_peers_for_engine_parts(part, capsys):
    """``--peer-isa avx2`` swaps vLLM's library in the benchmark's own process only: the engine parts, whose
    engines load the library vLLM picks, refuse it before anything is imported."""
    from qkvfuse_bench import vllm as bench_vllm

    with pytest.raises(SystemExit) as exc:
        bench_vllm.main(["--part", part, "--peer-isa", "avx2"])
    assert exc.value.code == 2
    assert "--peer-isa avx2 applies to the in-process parts" in capsys.readouterr().err


def test_vllm_bench_times_avx2_peers_only_against_the_avx2_build(monkeypatch, capsys):
    """``--peer-isa avx2`` compares like with like: with qkvfuse's library built for anything but AVX2 it is an
    error that says how to force the AVX2 build, before vLLM is imported."""
    from qkvfuse_bench import vllm as bench_vllm

    monkeypatch.setenv("QKVFUSE_CPU_CAPABILITY", "DEFAULT")
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.setenv(name, "")  # main's setdefaults stay inside this test
    with pytest.raises(SystemExit) as exc:
        bench_vllm.main(["--part", "norm", "--peer-isa", "avx2"])
    assert exc.value.code == 2
    assert "set QKVFUSE_CPU_CAPABILITY=AVX2 (qkvfuse's build here: DEFAULT)" in capsys.readouterr().err


def test_vllm_latency_rows_pair_rounds_and_profile_parts_split_by_name():
    """The vLLM bench's arithmetic (its engines run in ``make bench-vllm``): per-round ratios off/on, the ratio of
    the fastest rounds, and the profiler's split of a step into GEMM/MoE, attention and the rest."""
    from qkvfuse_bench import vllm as bench_vllm

    row = bench_vllm._paired_row("m", "compiled", "decode", on=[10.0, 20.0, 12.0], off=[11.0, 18.0, 12.0])
    assert row["off_over_on"] == pytest.approx(1.0) and row["min_off_over_min_on"] == pytest.approx(1.1)
    assert row["rounds"] == 3 and row["on_ms"] == 12.0 and row["off_ms"] == 12.0
    parts = bench_vllm.step_parts([("zentorch::zentorch_linear_unary", 5000.0), ("zentorch::zentorch_fused_moe", 1000.0),
                                   ("vllm::unified_attention_with_output", 300.0), ("_C::cpu_attn_reshape_and_cache", 100.0),
                                   ("qkvfuse::add_rmsnorm_inplace", 20.0), ("## Call CompiledFxGraph None ##", 80.0)])
    assert parts == pytest.approx({"gemm": 6.0, "attention": 0.4, "rest": 0.1})
    top = bench_vllm.rest_top([("aten::mm", 9000.0), ("qkvfuse::add_rmsnorm_inplace", 20.0), ("aten::copy_", 60.0),
                               ("## Call CompiledFxGraph None ##", 80.0), ("aten::copy_", 30.0)], n=2)
    assert top == [["aten::copy_", pytest.approx(0.09)], ["## Call CompiledFxGraph None ##", pytest.approx(0.08)]]


def test_vllm_bench_judges_the_peer_targets_per_cell():
    """The vLLM bench's verdicts: the bound in-place calls against each peer in every cell (the bare op shown, not
    judged), the split at T = 4096 against the copy, engines off/on (flagged when the rounds fall on both sides of
    the threshold); zentorch's verdicts carry a caveat when the qkvfuse build is forced (zentorch has no such
    switch), and a run without zentorch says so instead of judging nothing."""
    from qkvfuse_bench import vllm as bench_vllm

    def measured(part, impl, T, vs_vllm, roofline=0.5, **extra):
        return {"part": part, "T": T, "buffers": "hot", "impl": impl, "us": 1.0, "vs_vllm": vs_vllm,
                "roofline": roofline, **extra}

    rows = [measured("split", "qkvfuse QKNormRope.inplace", 16, 2.5, preset="Qwen3-8B"),
            measured("split", "qkvfuse bare op", 16, 2.9, preset="Qwen3-8B"),
            measured("split", "qkvfuse QKNormRope.inplace", 4096, 1.9, roofline=0.95, preset="Qwen3-8B"),
            measured("norm", "qkvfuse AddRMSNorm.inplace", 1, 1.1, hidden=4096, vs_zentorch=0.97),
            measured("norm", "qkvfuse bare op", 1, 1.2, hidden=4096, vs_zentorch=1.05),
            measured("norm", "vLLM _C.fused_add_rms_norm", 1, 1.0, hidden=4096, vs_zentorch=0.8),
            bench_vllm._paired_row("Qwen3-8B", "compiled", "decode", on=[10.0, 10.0], off=[11.0, 9.9])]
    got = {(t["target"].split(":")[0], t["cell"], t["target"].split()[-1]): t for t in bench_vllm.targets(rows)}
    verdicts = {k: t["verdict"] for k, t in got.items()}
    assert verdicts == {
        ("split", "Qwen3-8B T=16 hot", "vLLM"): "MET",
        ("split", "Qwen3-8B T=4096 hot", "vLLM"): "MISSED",
        ("split", "Qwen3-8B T=4096 hot", "copy"): "MET",
        ("add+RMSNorm", "hidden 4096 T=1 hot", "vLLM"): "MET",
        ("add+RMSNorm", "hidden 4096 T=1 hot", "zentorch"): "MISSED",
        ("engine", "Qwen3-8B compiled decode", "1)"): "MET (not resolved: rounds on both sides)",
    }
    assert "bare op x2.90" in got[("split", "Qwen3-8B T=16 hot", "vLLM")]["measured"]
    assert "bare op x1.05" in got[("add+RMSNorm", "hidden 4096 T=1 hot", "zentorch")]["measured"]
    assert "rounds 0.99-1.10" in got[("engine", "Qwen3-8B compiled decode", "1)")]["measured"]
    no_zentorch = [dict(r) for r in rows if r.get("part") == "norm"]
    for r in no_zentorch:
        del r["vs_zentorch"]
    assert [t["verdict"] for t in bench_vllm.targets(no_zentorch)] == ["MET", "NOT MEASURED"]
    forced = bench_vllm.targets(rows, forced="AVX2")
    assert [t["verdict"] for t in forced if "zentorch" in t["target"]] == [
        "MISSED (zentorch runs this CPU's code: judge it where AVX2 is the widest build)"]


@pytest.mark.parametrize("bench", ["vllm", "sglang", "cache", "sglang_cache"])
def test_engine_benches_refuse_an_unwritable_json_before_the_run(bench, tmp_path, capsys):
    """The vLLM and SGLang benches (engines and cache writes) check ``--json`` before anything runs, as the CLI
    does (a folder not made yet, like ``bench/results/`` in a fresh clone, would otherwise lose a long run's rows
    at its end)."""
    import importlib

    module = importlib.import_module(f"qkvfuse_bench.{bench}")
    path = tmp_path / "results" / "x.json"
    with pytest.raises(SystemExit) as exc:
        module.main(["--json", str(path)])
    assert exc.value.code == 2
    assert f"--json {path}: cannot be written" in capsys.readouterr().err
    assert not path.parent.exists()


# --------------------------------------------------------------------------------------------------------
# The main job's matrix (benchmarks.overview) and the screen's speed table built from it.
# --------------------------------------------------------------------------------------------------------
def test_overview_cells_measure_each_geometry_with_t_ascending():
    from qkvfuse.benchmarks import overview

    got = overview.cells((256, 1))
    assert got == [("split_qkv_rmsnorm_rope", "Qwen3-8B", "Qwen3-8B", 1), ("split_qkv_rmsnorm_rope", "Qwen3-8B",
                                                                          "Qwen3-8B", 256),
                   ("split_qkv_rmsnorm_rope", "GLM-4.5", "GLM-4.5", 1), ("split_qkv_rmsnorm_rope", "GLM-4.5",
                                                                        "GLM-4.5", 256),
                   ("add_rmsnorm", "Qwen3-8B", 4096, 1), ("add_rmsnorm", "Qwen3-8B", 4096, 256),
                   ("add_rmsnorm", "GLM-4.5", 5120, 1), ("add_rmsnorm", "GLM-4.5", 5120, 256)]
    status = overview.find_peers().status
    assert set(status) == {overview.VLLM, overview.ZENTORCH} and all(status.values())


def test_overview_times_an_importable_peer_beside_qkvfuse_and_the_screen_shows_it():
    """A peer found here gets its own column and a speed-up; a stand-in peer (qkvfuse's own op) keeps it fast."""
    import qkvfuse
    from qkvfuse.benchmarks import overview
    from qkvfuse.cli.run import speed_table

    peers = overview.Peers(vllm_norm=lambda x, residual, weight, eps: qkvfuse.add_rmsnorm_(x, residual, weight, eps))
    rows = overview.measure_cell(("add_rmsnorm", "tiny", 256, 4), peers, overview.UnfusedCompiler(False),
                                 overview.budget_for(0.02))
    impls = [r.impl for r in rows]
    assert impls == [overview.BOUND, overview.FUNCTIONAL, EAGER, overview.VLLM, COPY]
    assert rows[0].data.startswith("rotated") and all(r.rounds >= 3 and r.us > 0 for r in rows)
    assert [r.check for r in rows[:2]] == ["ok", "ok"]  # qkvfuse's own calls were checked before timing
    assert set(rows[0].vs) == {overview.FUNCTIONAL, EAGER, overview.VLLM}
    [line] = speed_table([dataclasses.asdict(r) for r in rows], "add_rmsnorm")
    assert set(line["us"]) == {overview.BOUND, overview.FUNCTIONAL, EAGER, overview.VLLM}
    assert line["vs_best"] == min(rows[0].vs[EAGER], rows[0].vs[overview.VLLM])
    assert line["vs_eager"] == rows[0].vs_eager and line["of_copy"] == rows[0].roofline


def test_hostcost_rows_cover_every_call_and_the_yardsticks_in_both_modes():
    """The Triton host-time bench (launches stubbed) at a tiny budget: every call of both ops, the bare ops and the
    yardsticks, in both grad modes, each a positive time; the Triton launcher module is restored afterwards."""
    pytest.importorskip("triton")
    from qkvfuse_bench import hostcost

    from qkvfuse.backends.triton import launch

    kernels = (launch.split_qkv_rmsnorm_rope_kernel, launch.add_rmsnorm_kernel, launch.driver)
    rows = hostcost.rows(seconds=0.02)
    assert (launch.split_qkv_rmsnorm_rope_kernel, launch.add_rmsnorm_kernel, launch.driver) == kernels
    calls = {(r["op"], r["call"]) for r in rows}
    assert len(rows) == 2 * len(calls) and {r["mode"] for r in rows} == {"default", "inference_mode"}
    assert {"QKNormRope.inplace (bound)", "AddRMSNorm.inplace (bound)", "qkv.split_with_sizes (the three views)",
            "torch.ops.aten.alias.default"} <= {call for _, call in calls}
    assert all(r["us"] > 0 for r in rows)
