"""``python -m qkvfuse``: the main job's screen, report, progress and exit status; flag checks (bad values and
unusable outputs are errors before anything runs), an output that fails after a run does not hide its summary, and
a backend that cannot run is a row with its reason."""

import io
import json
import os
import subprocess
import sys
import time

import pytest

import qkvfuse.benchmarks as benchmarks
import qkvfuse.benchmarks.overview as overview
import qkvfuse.benchmarks.report as report
from qkvfuse._verify import sections
from qkvfuse._verify.sections import Options, Section
from qkvfuse.benchmarks.timing import machine_info
from qkvfuse.cli import main
from qkvfuse.cli import progress as progress_mod
from qkvfuse.cli import run as run_mod

TINY = ["bench", "--preset", "Qwen3-8B", "--tokens", "1", "--dtype", "bf16", "--hidden", "256", "--no-compile",
        "--seconds", "0.05", "--op", "norm"]


def _no_run(monkeypatch):
    """Any attempt to run a verify section or the benchmark fails the test."""
    def boom(*args, **kwargs):
        raise AssertionError("ran although a flag was bad")

    monkeypatch.setattr(sections, "run", boom)
    monkeypatch.setattr(benchmarks, "run_bench", boom)


@pytest.mark.parametrize("argv, names", [
    (["verify", "--section", "nope"], ["ops", "models", "failure-modes", "conformance"]),
    (["verify", "--backend", "nope"], ["reference", "cpu", "triton"]),
    (["bench", "--op", "nope"], ["split", "norm", "percall"]),
    (["bench", "--dtype", "nope"], ["bf16", "fp32"]),
])
def test_unknown_choice_exits_nonzero_listing_the_choices(argv, names, monkeypatch, capsys):
    _no_run(monkeypatch)
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err and all(repr(n) in err for n in names), err


def test_unknown_backend_through_the_runner_lists_the_choices(capsys):
    assert sections.run(Options(backends=["nope"])) == 2
    out = capsys.readouterr().out
    assert "--backend nope" in out and "reference, cpu, triton" in out


def test_unknown_preset_exits_2_naming_the_known_ones(capsys):
    assert main(["bench", "--preset", "nope"]) == 2
    assert "known presets" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["verify"], ["bench"], ["bench", "--plot", "x.png"]])
@pytest.mark.parametrize("where", ["missing-dir", "directory"])
def test_unwritable_json_is_exit_2_before_the_run(command, where, tmp_path, monkeypatch, capsys):
    _no_run(monkeypatch)
    monkeypatch.chdir(tmp_path)
    path = str(tmp_path / "no_such_dir" / "x.json") if where == "missing-dir" else str(tmp_path)
    assert main(command + ["--json", path]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"{command[0]}: --json {path}: ")
    assert not os.path.exists("x.png")


def test_writable_json_check_leaves_no_file_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(sections, "run", lambda opts: 0)
    path = tmp_path / "v.json"
    assert main(["verify", "--json", str(path)]) == 0
    assert not path.exists()


def test_unwritable_plot_path_is_exit_2_before_the_run(tmp_path, monkeypatch, capsys):
    _no_run(monkeypatch)
    assert main(["bench", "--plot", str(tmp_path / "no_such_dir" / "b.png")]) == 2
    assert "--plot" in capsys.readouterr().err


def test_plot_without_matplotlib_fails_before_the_run_in_process(tmp_path, monkeypatch, capsys):
    _no_run(monkeypatch)
    monkeypatch.setattr(report, "matplotlib_unavailable", lambda: "ImportError: no matplotlib (test)")
    assert main(["bench", "--plot", str(tmp_path / "b.png")]) == 2
    err = capsys.readouterr().err
    assert "--plot" in err and "needs matplotlib" in err and "no matplotlib (test)" in err


def test_plot_without_matplotlib_fails_before_the_run_in_a_subprocess(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "import qkvfuse.benchmarks as b\n"
            "def boom(args): raise SystemExit('ran')\n"
            "b.run_bench = boom\n"
            "from qkvfuse.cli import main\n"
            f"sys.exit(main(['bench', '--plot', {str(tmp_path / 'b.png')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout == "" and "needs matplotlib" in proc.stderr and "ran" not in proc.stderr
    assert not (tmp_path / "b.png").exists()


def test_plot_failure_after_the_run_still_prints_the_summary(tmp_path, monkeypatch, capsys):
    def broken_plot(path, rows, title):
        raise OSError("disk full (test)")

    monkeypatch.setattr(benchmarks, "write_plot", broken_plot)
    json_path = tmp_path / "b.json"
    assert main(TINY + ["--plot", str(tmp_path / "b.png"), "--json", str(json_path)]) == 1
    captured = capsys.readouterr()
    assert "== summary ==" in captured.out
    last = captured.out.rstrip().splitlines()[-1]
    assert last.startswith("bench:") and f"wrote {json_path}" in last and "FAILED to write --plot" in last
    assert "could not write --plot" in captured.err and "disk full (test)" in captured.err
    assert json.loads(json_path.read_text())["rows"]


def test_backends_table_fails_a_requested_unavailable_backend_and_skips_the_others(monkeypatch):
    import qkvfuse.backends as backends

    monkeypatch.setattr(backends, "available_backends",
                        lambda: {"reference": "", "cpu": "no compiler (test)", "triton": "no triton (test)"})
    auto = sections.backends_section(Options())
    assert [(r["backend"], r["pass"]) for r in auto.rows] == [("reference", True), ("cpu", None), ("triton", None)]
    assert auto.failures == 0 and "skipped cpu: no compiler (test)" in auto.note
    asked = sections.backends_section(Options(backends=["cpu", "reference"]))
    assert [(r["backend"], r["pass"], r["detail"]) for r in asked.rows] == [
        ("reference", True, ""), ("cpu", False, "no compiler (test)")]
    assert asked.failures == 1


def test_verify_with_an_unrunnable_backend_is_a_failed_row_not_a_traceback(tmp_path):
    """QKVFUSE_CPU_CAPABILITY beyond this CPU (or no compiler) makes the cpu backend unavailable: a failed row with
    the reason when it was asked for, and the sections that need it skipped."""
    env = dict(os.environ, CXX="/nonexistent/c++", QKVFUSE_BUILD_DIR=str(tmp_path / "build"))
    json_path = tmp_path / "v.json"
    proc = subprocess.run([sys.executable, "-m", "qkvfuse", "verify", "--quick", "--backend", "cpu",
                           "--json", str(json_path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "FAIL detail:" in proc.stdout and "no requested backend can run here" in proc.stdout
    result = json.loads(json_path.read_text())
    [backends_table] = result["sections"]
    [row] = backends_table["rows"]
    assert row["backend"] == "cpu" and row["pass"] is False and row["detail"]


# ---------------------------------------------------------------------------------------------------------------
# The main job: `python -m qkvfuse` (what `make run` calls). Verify runs made-up sections and the benchmark one
# geometry at tiny budgets, so these tests check the screen, the report and the exit status, never speed.
# ---------------------------------------------------------------------------------------------------------------
FAST = ["--tokens", "256", "--seconds", "0.02", "--no-compile"]


def _sections(monkeypatch, failing=False):
    """Two host sections that check backends (so the backends table runs first): one passes, one fails on
    demand; each reports its checks to the progress object as the real ones do."""
    def good(opts):
        sections.planned(2)
        sections.advance(2)
        return Section("good checks", ("check", "backend", "pass"),
                       [{"check": "a", "backend": "cpu", "pass": True}, {"check": "b", "backend": "cpu", "pass": True}])

    def bad(opts):
        sections.planned(1)
        sections.advance(1)
        return Section("bad checks", ("check", "backend", "max err", "pass"),
                       [{"check": "rotation of the last pair", "backend": "cpu", "max err": 0.5, "pass": not failing,
                         "detail": "max err 0.5 > 0.01 (test)"}])

    fake = {"good": good, "bad": bad}
    monkeypatch.setattr(sections, "REGISTRY", {n: sections.Entry(f"x:{n}", False, n, True) for n in fake})
    monkeypatch.setattr(sections, "load", lambda name: fake[name])


def _one_geometry(monkeypatch):
    monkeypatch.setattr(overview, "GEOMETRIES", (("Qwen3-8B", "Qwen3-8B", 4096),))


def test_main_job_prints_one_screen_and_writes_a_report_that_parses(tmp_path, monkeypatch, capsys):
    import matplotlib.image

    _sections(monkeypatch)
    _one_geometry(monkeypatch)
    report_dir = tmp_path / "report"
    assert main(["--report", str(report_dir)] + FAST) == 0
    captured = capsys.readouterr()
    lines = captured.out.rstrip("\n").splitlines()
    assert len(lines) <= 50, captured.out
    text = captured.out
    first = lines[0]
    assert machine_info()["cpu"] in first and "native build" in first and "torch" in first and "threads" in first
    assert lines[1].startswith("backends: ") and "reference" in lines[1]
    assert any(line.split()[:3] == ["good", "2/2", "passed"] for line in lines), text
    assert any(line.split()[:3] == ["bad", "1/1", "passed"] for line in lines), text
    assert "split QKV + QK-RMSNorm + RoPE" in text and "add + RMSNorm" in text
    assert "bound" in text and "functional" in text and "eager" in text and "of copy" in text
    assert f"full report: {report_dir / 'report.md'}" in text
    assert lines[-1].startswith("result: OK") and "exit 0" in lines[-1]
    for word in ("issue", "session", "MET", "MISSED", "target"):
        assert word not in text, word
    # the report: Markdown with the tables, JSON that loads, PNGs that open
    md = (report_dir / "report.md").read_text()
    assert "## Speed" in md and "== add_rmsnorm: Qwen3-8B" in md and "== good checks ==" in md
    data = json.loads((report_dir / "report.json").read_text())
    assert data["exit"] == {"code": 0, "reasons": []}
    assert {r["impl"] for r in data["bench"]["rows"]} >= {overview.BOUND, overview.FUNCTIONAL, "eager unfused"}
    assert all(r["check"] == "ok" for r in data["bench"]["rows"] if r["impl"] in (overview.BOUND, overview.FUNCTIONAL))
    for png in ("speed.png", "accuracy.png") if (report_dir / "accuracy.png").exists() else ("speed.png",):
        image = matplotlib.image.imread(str(report_dir / png))
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    # not a terminal: no bars, at most one plain line per step, on stderr
    assert "\r" not in captured.err
    steps = [line for line in captured.err.splitlines() if line.startswith(("verify ", "bench:"))]
    assert [s.split(":")[0] for s in steps] == ["verify backends", "verify good", "verify bad", "bench"], captured.err


def test_a_failed_check_is_listed_with_its_rerun_command_and_exits_1(tmp_path, monkeypatch, capsys):
    _sections(monkeypatch, failing=True)
    assert main(["--report", str(tmp_path / "r"), "--no-bench", "--quiet"]) == 1
    text = capsys.readouterr().out
    assert any(line.split()[:3] == ["bad", "0/1", "FAILED"] for line in text.splitlines()), text
    assert "FAILED bad: rotation of the last pair cpu: max err 0.5 > 0.01 (test)" in text
    assert "rerun: python -m qkvfuse verify --section bad --backend cpu" in text
    assert text.rstrip().splitlines()[-1].startswith("result: FAILED: 1 verify check failed")
    data = json.loads((tmp_path / "r" / "report.json").read_text())
    assert data["exit"]["code"] == 1
    assert "rerun: `python -m qkvfuse verify --section bad --backend cpu`" in (tmp_path / "r" / "report.md").read_text()


def test_a_requested_backend_that_cannot_run_exits_1_and_says_which(tmp_path, monkeypatch, capsys):
    import qkvfuse.backends as backends

    _sections(monkeypatch)
    monkeypatch.setattr(backends, "available_backends",
                        lambda: {"reference": "", "cpu": "", "triton": "no triton (test)"})
    assert main(["--report", str(tmp_path / "r"), "--no-bench", "--backend", "triton", "--backend", "cpu"]) == 1
    text = capsys.readouterr().out
    assert "triton FAILED: no triton (test)" in text
    assert "requested backend triton could not run (no triton (test))" in text.splitlines()[-1]


def test_a_wrong_timed_result_fails_the_run(tmp_path, monkeypatch, capsys):
    _sections(monkeypatch)
    _one_geometry(monkeypatch)
    monkeypatch.setattr(overview, "cells", lambda tokens: [("add_rmsnorm", "tiny", 256, 4)])
    monkeypatch.setattr(overview, "check_norm", lambda *args, **kw: "FAIL: y: wrong (test)")
    assert main(["--report", str(tmp_path / "r"), "--quiet"] + FAST) == 1
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert last.startswith("result: FAILED") and "2 timed calls gave wrong results" in last


def test_quiet_prints_the_summary_only_and_json_keeps_working(tmp_path, monkeypatch, capsys):
    _sections(monkeypatch)
    json_path = tmp_path / "run.json"
    assert main(["run", "--report", str(tmp_path / "r"), "--no-bench", "--quiet", "--json", str(json_path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.startswith("qkvfuse ")
    assert "speed: not measured (--no-bench)" in captured.out
    assert json.loads(json_path.read_text())["verify"]["sections"][1]["name"] == "good"


@pytest.mark.parametrize("argv", [[], ["--quiet"], ["run"]])
def test_no_sub_command_is_the_main_job(argv, monkeypatch):
    seen = []
    monkeypatch.setattr(run_mod, "run_main", lambda args: seen.append(args) or 0)
    assert main(argv) == 0
    assert seen and seen[0].command == "run" and seen[0].report == run_mod.DEFAULT_REPORT_DIR


@pytest.mark.parametrize("argv, message", [(["--report", "FILE"], "exists and is not a folder"),
                                           (["--json", "missing/x.json"], "--json"),
                                           (["--tokens", "0"], "--tokens"), (["--seconds", "0"], "--seconds")])
def test_bad_main_job_flags_are_exit_2_before_anything_runs(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("")
    monkeypatch.setattr(sections, "collect", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err


def test_progress_on_a_terminal_is_a_bar_with_count_and_time_left():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert progress_mod.progress_mode(False, Terminal()) == "bar"
    assert progress_mod.progress_mode(False, io.StringIO()) == "plain"
    assert progress_mod.progress_mode(True, Terminal()) == "quiet"
    stream = Terminal()
    bar = progress_mod.Progress("bar", stream=stream)
    bar.start("verify ops")
    bar.planned(10)
    time.sleep(0.2)  # tqdm redraws at most every 0.1 s
    bar.advance(4)
    bar.end()
    text = stream.getvalue()
    assert "verify ops" in text and "4/10" in text and "<" in text  # tqdm's elapsed<remaining
    plain = io.StringIO()
    line = progress_mod.Progress("plain", stream=plain)
    line.start("bench", total=3)
    line.advance(3)
    line.end(line="3 cells in 1 s")
    assert plain.getvalue() == "bench: 3 cells in 1 s\n"


def test_first_use_build_shows_a_bar_counting_the_compiled_files(tmp_path, monkeypatch):
    """The build's progress counts the objects the compilers write into the build folder (a library built before
    is found at once: no bar)."""
    import qkvfuse.backends.cpu as cpu

    monkeypatch.setenv("QKVFUSE_BUILD_DIR", str(tmp_path))
    folder = tmp_path / f"key.tmp-{os.getpid()}-0a1b"

    def slow_build():
        folder.mkdir()
        for i in range(cpu_sources):
            time.sleep(0.4)
            (folder / f"{i}-kernel.o").write_bytes(b"")
        time.sleep(0.4)
        return str(tmp_path / "lib.so")

    cpu_sources = len(cpu._build_inputs(cpu.capability())[1])
    monkeypatch.setattr(cpu, "prebuild", slow_build)
    plain = io.StringIO()
    result = run_mod._build(progress_mod.Progress("plain", stream=plain))
    assert result["ok"] and result["path"] == str(tmp_path / "lib.so")
    assert plain.getvalue().startswith("build native CPU library (first use): ")
    events = []

    class Counting(progress_mod.Progress):
        def advance(self, n=1):
            events.append(n)

    folder.rename(tmp_path / "done")
    run_mod._build(Counting("quiet"))
    assert sum(events) == cpu_sources
    monkeypatch.setattr(cpu, "prebuild", lambda: str(tmp_path / "lib.so"))  # built before: found at once
    quiet_when_cached = io.StringIO()
    run_mod._build(progress_mod.Progress("plain", stream=quiet_when_cached))
    assert quiet_when_cached.getvalue() == ""
