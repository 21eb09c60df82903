"""``python -m qkvfuse`` flag checks: bad values and unusable outputs are errors before anything runs, an output
that fails after a run does not hide its summary, and a backend that cannot run is a row with its reason."""

import json
import os
import subprocess
import sys

import pytest

import qkvfuse.benchmarks as benchmarks
import qkvfuse.benchmarks.report as report
from qkvfuse._verify import sections
from qkvfuse._verify.sections import Options
from qkvfuse.cli import main

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
