"""The native build (``qkvfuse.backends.cpu.build``): a killed build never blocks the next, racing first calls
build once, the key follows the sources, the fast path needs no compiler, a failed compile caches nothing.

Tiny C++ sources written to ``tmp_path`` keep every build to about a second (one source includes
``torch/library.h`` to check that the library links against libtorch and loads with
``torch.ops.load_library``; that compile takes ~10 s). Builds that must die or race run in subprocesses that
load ``build.py`` by its path: the module is self-contained, so these tests do not depend on the rest of the
package importing.
"""

from __future__ import annotations

import ctypes
import fcntl
import importlib.util
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BUILD_PY = Path(__file__).resolve().parents[2] / "src" / "qkvfuse" / "backends" / "cpu" / "build.py"
REAL_CXX = shutil.which(os.environ.get("CXX") or "c++")

pytestmark = pytest.mark.skipif(REAL_CXX is None or not hasattr(fcntl, "flock"),
                                reason="needs a C++ compiler and flock")

# argv: name root source...; prints the library's path as the last stdout line.
BUILDER = f"""
import importlib.util, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("qkvfuse_build_under_test", {str(BUILD_PY)!r})
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)
path = build.build_library(sys.argv[1], [Path(s) for s in sys.argv[3:]], root=Path(sys.argv[2]))
if len(sys.argv) > 3 and Path(sys.argv[3]).read_text().count("TORCH_LIBRARY"):
    import torch
    torch.ops.load_library(str(path))
    ns = sys.argv[1]
    assert getattr(torch.ops, ns).plus_one(41) == 42
print(path)
"""


def _load_build_module():
    spec = importlib.util.spec_from_file_location("qkvfuse_build_in_process", BUILD_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load_build_module()


def _plain_source(path: Path, value: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'extern "C" int qkvfuse_test_value() {{ return {value}; }}\n')
    return path


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    env.pop("CXX", None)
    env.update(extra)
    return env


def _builder(name: str, root: Path, sources, env: dict, **popen) -> subprocess.Popen:
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen([sys.executable, "-c", BUILDER, name, str(root), *map(str, sources)], env=env,
                            text=True, **popen)


def _finish(proc: subprocess.Popen, timeout: float = 60) -> tuple:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the build did not finish within {timeout} s (it hangs?):\n{err}")
    assert proc.returncode == 0, err
    return Path(out.strip().splitlines()[-1]), err


def _slow_compiler(tmp_path: Path, seconds: float) -> tuple:
    """A ``CXX`` that sleeps before each compile while ``flag`` exists (``--version`` stays fast)."""
    flag = tmp_path / "slow"
    flag.touch()
    script = tmp_path / "slow-c++"
    script.write_text(f'#!/bin/sh\nif [ -e "{flag}" ]; then case " $* " in *" -c "*) sleep {seconds};; esac; fi\n'
                      f'exec "{REAL_CXX}" "$@"\n')
    script.chmod(0o755)
    return script, flag


def test_cache_root_precedence(monkeypatch, tmp_path):
    for var in ("QKVFUSE_BUILD_DIR", "TORCH_EXTENSIONS_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert build.cache_root() == tmp_path / "home" / ".cache" / "qkvfuse"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build.cache_root() == tmp_path / "xdg" / "qkvfuse"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert build.cache_root() == tmp_path / "ext" / "qkvfuse"
    monkeypatch.setenv("QKVFUSE_BUILD_DIR", str(tmp_path / "mine"))
    assert build.cache_root() == tmp_path / "mine"


def test_killed_build_does_not_block_the_next(tmp_path):
    root = tmp_path / "cache"
    cxx, flag = _slow_compiler(tmp_path, 60)
    src = _plain_source(tmp_path / "src" / "lib.cpp", 7)
    env = _env(CXX=str(cxx))
    # The victim writes to a file, not a pipe: its orphaned compiler would keep a pipe open.
    log = open(tmp_path / "victim.log", "w")
    victim = _builder("qkvfuse_killed", root, [src], env, start_new_session=True, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 45
        while not list(root.glob("*.tmp-*")) and time.monotonic() < deadline and victim.poll() is None:
            time.sleep(0.05)
        assert list(root.glob("*.tmp-*")), f"the builder never started: {(tmp_path / 'victim.log').read_text()}"
        (lock,) = root.glob("*.lock")
        with open(lock, "rb") as held:  # the victim holds the lock while it builds
            with pytest.raises(BlockingIOError):
                fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        victim.kill()  # SIGKILL to the builder alone: its sleeping compiler lives on as an orphan
        victim.wait()
        assert "qkvfuse: building" in (tmp_path / "victim.log").read_text()
        flag.unlink()
        path, err = _finish(_builder("qkvfuse_killed", root, [src], env), timeout=60)
        assert err.count("qkvfuse: building") == 1, err
        assert "waiting" not in err, err
        assert path.is_file() and ctypes.CDLL(str(path)).qkvfuse_test_value() == 7
        assert not list(root.glob("*.tmp-*")), "the dead build's folder was not removed"
    finally:
        try:
            os.killpg(victim.pid, signal.SIGKILL)  # the orphaned compiler
        except (ProcessLookupError, PermissionError):
            pass
        victim.wait()
        log.close()


def test_racing_first_calls_build_once(tmp_path):
    root = tmp_path / "cache"
    cxx, _ = _slow_compiler(tmp_path, 3)  # the build outlasts the second process's start
    src = _plain_source(tmp_path / "src" / "lib.cpp", 3)
    env = _env(CXX=str(cxx))
    procs = [_builder("qkvfuse_race", root, [src], env) for _ in range(2)]
    results = [_finish(p, timeout=60) for p in procs]
    (path,) = {p for p, _ in results}
    errs = "".join(err for _, err in results)
    assert errs.count("qkvfuse: building") == 1, errs
    assert errs.count("qkvfuse: built") == 1, errs
    assert ctypes.CDLL(str(path)).qkvfuse_test_value() == 3
    assert len([d for d in root.iterdir() if d.is_dir()]) == 1


def test_key_follows_contents_and_checkouts_do_not_collide(tmp_path, capfd):
    root = tmp_path / "cache"
    a = _plain_source(tmp_path / "a" / "lib.cpp", 1)
    b = _plain_source(tmp_path / "b" / "lib.cpp", 2)
    same_as_a = _plain_source(tmp_path / "c" / "lib.cpp", 1)

    def built(src, **kw):
        path = build.build_library("qkvfuse_checkout", [src], root=root, **kw)
        return path, capfd.readouterr().err.count("qkvfuse: building")

    path_a, n = built(a)
    assert n == 1
    path_b, n = built(b)
    assert n == 1 and path_b.parent != path_a.parent
    assert built(a) == (path_a, 0)  # A again: the fast path, B did not build over it
    assert built(same_as_a) == (path_a, 0)  # identical contents elsewhere share the build
    assert ctypes.CDLL(str(path_a)).qkvfuse_test_value() == 1
    assert ctypes.CDLL(str(path_b)).qkvfuse_test_value() == 2
    # A header in an include dir is part of the key, and so are the flags.
    header = tmp_path / "a" / "lib.h"
    header.write_text("// v1\n")
    path_h1, n = built(a, include_dirs=[tmp_path / "a"])
    assert n == 1 and path_h1.parent not in (path_a.parent, path_b.parent)
    header.write_text("// v2\n")
    path_h2, n = built(a, include_dirs=[tmp_path / "a"])
    assert n == 1 and path_h2.parent != path_h1.parent
    path_f, n = built(a, extra_cflags=["-O1"])
    assert n == 1 and path_f.parent != path_a.parent
    assert build.library_key("qkvfuse_checkout", [a]) == path_a.parent.name


def test_fast_path_needs_no_compiler(tmp_path):
    root = tmp_path / "cache"
    ns = f"qkvfuse_buildtest_{secrets.token_hex(4)}"
    op = tmp_path / "src" / "op.cpp"
    op.parent.mkdir(parents=True)
    op.write_text("#include <torch/library.h>\n#include <cstdint>\n"
                  "static int64_t plus_one(int64_t x) { return x + 1; }\n"
                  f'TORCH_LIBRARY({ns}, m) {{ m.def("plus_one(int x) -> int", &plus_one); }}\n')
    other = _plain_source(tmp_path / "src" / "other.cpp", 5)
    path, err = _finish(_builder(ns, root, [op, other], _env()), timeout=120)
    assert err.count("qkvfuse: building") == 1, err
    bare = tmp_path / "bare-bin"  # a PATH with no compiler and no ninja
    bare.mkdir()
    again, err = _finish(_builder(ns, root, [op, other], _env(CXX="/nonexistent/c++", PATH=str(bare))))
    assert again == path and "qkvfuse" not in err, err
    again, err = _finish(_builder(ns, root, [op, other], _env(PATH=str(bare))))  # no CXX, no c++ on PATH
    assert again == path and "qkvfuse" not in err, err


def test_no_compiler_and_no_prebuilt_library_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    src = _plain_source(tmp_path / "lib.cpp", 1)
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler.*holds no prebuilt qkvfuse_nocc"):
        build.build_library("qkvfuse_nocc", [src], root=tmp_path / "cache")


def test_compile_error_raises_and_caches_nothing(tmp_path, capfd):
    root = tmp_path / "cache"
    good = _plain_source(tmp_path / "good.cpp", 1)
    bad = tmp_path / "bad.cpp"
    bad.write_text("int broken() { return qkvfuse_undeclared_name; }\n")
    with pytest.raises(RuntimeError) as info:
        build.build_library("qkvfuse_broken", [good, bad], root=root)
    message = str(info.value)
    first = message.splitlines()[0]
    assert "compiling bad.cpp" in first and "error" in first and "qkvfuse_undeclared_name" in first, message
    assert "command: " in message and "-c " in message and str(bad) in message
    assert not list(root.rglob("*.so")) and not list(root.glob("*.tmp-*"))
    assert "failed" in capfd.readouterr().err
    # A fixed source then builds.
    bad.write_text("int broken() { return 0; }\n")
    assert build.build_library("qkvfuse_broken", [good, bad], root=root).is_file()
