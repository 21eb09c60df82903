"""Build a plain shared library against libtorch once per content key, with a lock that cannot hang.

:func:`build_library` compiles C++ sources with the C++ compiler directly (no ninja, no
:func:`torch.utils.cpp_extension.load`) into a shared library that is *not* a Python extension module; the
caller loads it with :func:`torch.ops.load_library`, which runs its ``TORCH_LIBRARY*`` registrations.

Layout under :func:`cache_root` (one key per set of inputs, see :func:`library_key`)::

    <root>/<key>/<name>.so          the finished library; it only ever appears by an atomic os.replace
    <root>/<key>/build.log          the commands and compiler output of the build that made it
    <root>/<key>.lock               flock(2) target; the kernel drops the lock when its holder dies
    <root>/<key>.tmp-<pid>-<hex>    a build in progress (or a dead one, removed by the next builder)

The fast path -- the finished file exists -- takes no lock and runs nothing but ``$CXX --version`` (once per
process), so a runtime image holding a prebuilt library works read-only; without any compiler on ``PATH`` it
takes the newest prebuilt library whose inputs other than the compiler match. Only this module's stdlib and
torch imports are used, so it can be loaded on its own.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["build_library", "cache_root", "library_key"]

# Bump when the recipe below changes in a way that should rebuild every cached library.
_RECIPE = "qkvfuse-build-1"
# torch 2.13's own cpp_extension compiles extensions as C++20 (its headers are tested with it).
_BASE_CFLAGS = ("-fPIC", "-std=c++20")
_TORCH_LIBS = ("-lc10", "-ltorch", "-ltorch_cpu")
_HEADER_SUFFIXES = (".h", ".hpp", ".cpp")

_compilers: Dict[Tuple[str, str], Optional[Tuple[List[str], str, str]]] = {}


def cache_root() -> Path:
    """The folder holding every built library.

    Returns
    -------
    Path
        ``$QKVFUSE_BUILD_DIR``, else ``$TORCH_EXTENSIONS_DIR/qkvfuse``, else ``$XDG_CACHE_HOME/qkvfuse``, else
        ``~/.cache/qkvfuse``. Not created here.
    """
    root = os.environ.get("QKVFUSE_BUILD_DIR")
    if root:
        return Path(root)
    ext_dir = os.environ.get("TORCH_EXTENSIONS_DIR")
    if ext_dir:
        return Path(ext_dir) / "qkvfuse"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "qkvfuse"


def _compiler() -> Optional[Tuple[List[str], str, str]]:
    """``(argv, resolved path, first line of --version)`` of ``$CXX`` (else ``c++``), or None if it cannot run.

    Cached per process for each value of ``CXX`` and ``PATH``.
    """
    cxx = os.environ.get("CXX") or "c++"
    cache_key = (cxx, os.environ.get("PATH", ""))
    if cache_key not in _compilers:
        found: Optional[Tuple[List[str], str, str]] = None
        argv = shlex.split(cxx)
        exe = shutil.which(argv[0]) if argv else None
        if exe is not None:
            try:
                out = subprocess.run([exe, *argv[1:], "--version"], stdin=subprocess.DEVNULL,
                                     capture_output=True, text=True, timeout=60)
                if out.returncode == 0:
                    lines = out.stdout.strip().splitlines()
                    found = ([exe, *argv[1:]], os.path.realpath(exe), lines[0].strip() if lines else "")
            except (OSError, subprocess.SubprocessError):
                pass
        _compilers[cache_key] = found
    return _compilers[cache_key]


def _abi() -> int:
    return int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))


def _prefix(name: str) -> str:
    torch_version = torch.__version__.replace("+", "_")
    return f"{name}-torch{torch_version}-py{sys.version_info[0]}{sys.version_info[1]}"


def _inputs_digest(name: str, sources: Sequence[Path], include_dirs: Sequence[Path], extra_cflags: Sequence[str],
                   extra_ldflags: Sequence[str]) -> str:
    """sha256 of everything that decides the binary except the compiler."""
    h = hashlib.sha256()

    def add(tag: str, data: bytes) -> None:
        h.update(f"{tag}:{len(data)}:".encode())
        h.update(data)

    add("recipe", _RECIPE.encode())
    add("name", name.encode())
    for src in sources:
        src = Path(src)
        add("source", src.name.encode())
        add("content", src.read_bytes())
    for inc in include_dirs:
        inc = Path(inc)
        headers = sorted(p for p in inc.rglob("*") if p.suffix in _HEADER_SUFFIXES and p.is_file())
        for p in headers:
            add("header", p.relative_to(inc).as_posix().encode())
            add("content", p.read_bytes())
    add("cflags", "\0".join([*_BASE_CFLAGS, *extra_cflags]).encode())
    add("ldflags", "\0".join([*_TORCH_LIBS, *extra_ldflags]).encode())
    add("torch", f"{torch.__version__}\0{torch.version.git_version}".encode())
    add("python", f"{sys.implementation.name}{sys.version_info[0]}.{sys.version_info[1]}".encode())
    add("abi", str(_abi()).encode())
    return h.hexdigest()


def _compiler_digest(compiler: Tuple[List[str], str, str]) -> str:
    argv, path, version = compiler
    return hashlib.sha256("\0".join([path, *argv[1:], version]).encode()).hexdigest()


def library_key(name: str, sources: Sequence[Path], include_dirs: Sequence[Path] = (),
                extra_cflags: Sequence[str] = (), extra_ldflags: Sequence[str] = ()) -> str:
    """The cache folder name of a library: ``<name>-torch<ver>-py<XY>-<inputs hash>-<compiler hash>``.

    Parameters
    ----------
    name, sources, include_dirs, extra_cflags, extra_ldflags
        As for :func:`build_library`.

    Returns
    -------
    str
        ``<inputs hash>`` (16 hex digits of sha256) covers the name, the contents of every source and of
        every ``.h``/``.hpp``/``.cpp`` file under the include dirs, all flags, ``torch.__version__``,
        ``torch.version.git_version``, the Python version and ``torch._C._GLIBCXX_USE_CXX11_ABI``;
        ``<compiler hash>`` (8 hex digits) covers the compiler's resolved path, its arguments in ``$CXX`` and
        the first line of its ``--version``.

    Raises
    ------
    RuntimeError
        If ``$CXX`` (else ``c++``) cannot be found or run.
    """
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError(_no_compiler_message())
    inputs = _inputs_digest(name, sources, include_dirs, extra_cflags, extra_ldflags)
    return f"{_prefix(name)}-{inputs[:16]}-{_compiler_digest(compiler)[:8]}"


def _no_compiler_message() -> str:
    cxx = os.environ.get("CXX") or "c++"
    return f"no C++ compiler: {cxx!r} is not on PATH or does not run (install g++ or set CXX)"


def _prebuilt_without_compiler(root: Path, name: str, inputs: str) -> Optional[Path]:
    """The newest finished library for these inputs built by any compiler (used when none is installed)."""
    pattern = re.compile(re.escape(f"{_prefix(name)}-{inputs[:16]}-") + r"[0-9a-f]{8}")
    best: Optional[Tuple[float, Path]] = None
    try:
        entries = list(root.iterdir())
    except OSError:
        return None
    for entry in entries:
        if not pattern.fullmatch(entry.name):
            continue
        so = entry / f"{name}.so"
        try:
            mtime = so.stat().st_mtime
        except OSError:
            continue
        if best is None or mtime > best[0]:
            best = (mtime, so)
    return best[1] if best else None


def _say(message: str) -> None:
    print(f"qkvfuse: {message}", file=sys.stderr, flush=True)


def _excerpt(log: str, limit: int = 12) -> List[str]:
    """The first compiler error and the lines after it (else the log's last lines)."""
    lines = [line.rstrip() for line in log.splitlines() if line.strip()]
    first = next((i for i, line in enumerate(lines) if re.search(r"\b(error|fatal error)\b", line)), None)
    if first is None:
        return lines[-limit:]
    return lines[first:first + limit]


def _failure(what: str, cmd: Sequence[str], rc: int, log: str) -> RuntimeError:
    """The error for a failed compile or link: first error line first, then its context and the command."""
    excerpt = _excerpt(log)
    lines = [f"{what} failed: {excerpt[0].strip() if excerpt else f'exit status {rc}'}"]
    lines += ["    " + line for line in excerpt[1:]]
    lines.append(f"  (exit status {rc}) command: {shlex.join(cmd)}")
    return RuntimeError("\n".join(lines))


def _lock(path: Path, folder: Path) -> int:
    """Open ``path`` and take an exclusive flock on it (announcing a wait once); returns the fd."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # not inherited by the compilers (PEP 446)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another process that is building the native CPU library in {folder} ...")
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            # A filesystem without flock (some network mounts): build unlocked. The temporary folder and the
            # atomic rename still keep every finished file whole; at worst two processes both build.
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
    except BaseException:
        os.close(fd)
        raise
    return fd


def _run_all(cmds: Sequence[List[str]], logs: Sequence[Path]) -> List[int]:
    """Start every command at once (output to its log file), then wait for all; kill leftovers on error."""
    procs: List[subprocess.Popen] = []
    try:
        for cmd, log in zip(cmds, logs):
            with open(log, "wb") as out:
                procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT))
        return [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _compile_and_link(name: str, sources: Sequence[Path], include_dirs: Sequence[Path], extra_cflags: Sequence[str],
                      extra_ldflags: Sequence[str], compiler: List[str], tmp: Path, verbose: bool) -> Path:
    from torch.utils import cpp_extension

    includes = [f"-I{Path(d).resolve()}" for d in include_dirs]
    for d in cpp_extension.include_paths("cpu"):
        includes += ["-isystem", d]
    cflags = [*_BASE_CFLAGS, *includes, f"-D_GLIBCXX_USE_CXX11_ABI={_abi()}", *extra_cflags]
    lib_dirs = cpp_extension.library_paths("cpu")
    ldflags = [f"-L{d}" for d in lib_dirs] + list(_TORCH_LIBS) + [f"-Wl,-rpath,{d}" for d in lib_dirs]
    ldflags += list(extra_ldflags)

    objects = [tmp / f"{i}-{Path(src).stem}.o" for i, src in enumerate(sources)]
    cmds = [[*compiler, *cflags, "-c", str(Path(src).resolve()), "-o", str(obj)]
            for src, obj in zip(sources, objects)]
    logs = [obj.with_suffix(".log") for obj in objects]
    if verbose:
        for cmd in cmds:
            _say(shlex.join(cmd))
    codes = _run_all(cmds, logs)
    texts = [log.read_text(errors="replace") for log in logs]
    if verbose:
        for text in texts:
            if text.strip():
                sys.stderr.write(text)
    for src, cmd, rc, text in zip(sources, cmds, codes, texts):
        if rc != 0:
            raise _failure(f"compiling {Path(src).name} for {name}", cmd, rc, text)

    library = tmp / f"{name}.so"
    link = [*compiler, "-shared", *map(str, objects), "-o", str(library), *ldflags]
    if verbose:
        _say(shlex.join(link))
    link_log = tmp / "link.log"
    (rc,) = _run_all([link], [link_log])
    link_text = link_log.read_text(errors="replace")
    if rc != 0 or not library.is_file():
        raise _failure(f"linking {name}", link, rc, link_text)
    with open(tmp / "build.log", "w") as out:
        for cmd, text in zip([*cmds, link], [*texts, link_text]):
            out.write(f"$ {shlex.join(cmd)}\n{text}")
    return library


def build_library(name: str, sources: Sequence[Path], *, include_dirs: Sequence[Path] = (),
                  extra_cflags: Sequence[str] = (), extra_ldflags: Sequence[str] = (), root: Optional[Path] = None,
                  verbose: bool = False) -> Path:
    """Build (once per :func:`library_key`) a plain shared library linked against libtorch; return its path.

    The result is not a Python extension module: load it with ``torch.ops.load_library(path)``.

    Parameters
    ----------
    name : str
        Library name; the file is ``<name>.so``.
    sources : sequence of Path
        C++ files, each compiled to an object by its own compiler process (all run at once), then linked with
        ``-shared -lc10 -ltorch -ltorch_cpu`` and an rpath to torch's library folder.
    include_dirs : sequence of Path
        The project's header folders: passed as ``-I`` and every ``.h``/``.hpp``/``.cpp`` file under them is
        part of the key (do not pass torch's or system folders here).
    extra_cflags, extra_ldflags : sequence of str
        Added after ``-fPIC -std=c++20``, the torch include folders and ``-D_GLIBCXX_USE_CXX11_ABI`` (compile),
        and after the torch libraries (link).
    root : Path, optional
        Cache folder (default :func:`cache_root`).
    verbose : bool
        Echo the commands and the compiler output to stderr.

    Returns
    -------
    Path
        ``<root>/<key>/<name>.so``. Returned at once, without lock or compiler process, when it exists; with no
        compiler installed, the newest prebuilt library for the same inputs is returned.

    Raises
    ------
    RuntimeError
        If there is no compiler and no prebuilt library, or if a compile or the link fails: the message starts
        with the first compiler error and ends with the command. A failed build leaves no library behind.

    Notes
    -----
    A builder holds an exclusive ``flock`` on ``<root>/<key>.lock``; the kernel releases it when the process
    exits or is killed, so an interrupted build never blocks the next one. Each build happens in a fresh
    ``<root>/<key>.tmp-<pid>-<hex>`` folder (leftovers of dead builds are removed under the lock) and the library
    is moved into place with :func:`os.replace`. One line on stderr announces a build and one its end.
    """
    root = Path(root) if root is not None else cache_root()
    sources = [Path(s) for s in sources]
    include_dirs = [Path(d) for d in include_dirs]
    inputs = _inputs_digest(name, sources, include_dirs, extra_cflags, extra_ldflags)
    compiler = _compiler()
    if compiler is None:
        prebuilt = _prebuilt_without_compiler(root, name, inputs)
        if prebuilt is not None:
            return prebuilt
        raise RuntimeError(f"{_no_compiler_message()}, and {root} holds no prebuilt {name} for this version")
    key = f"{_prefix(name)}-{inputs[:16]}-{_compiler_digest(compiler)[:8]}"
    folder = root / key
    final = folder / f"{name}.so"
    if final.is_file():
        return final

    root.mkdir(parents=True, exist_ok=True)
    fd = _lock(root / f"{key}.lock", folder)
    try:
        if final.is_file():  # built by the process we waited for
            return final
        for stale in root.glob(f"{key}.tmp-*"):  # we hold the lock: any other build folder is a dead one
            shutil.rmtree(stale, ignore_errors=True)
        tmp = root / f"{key}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        start = time.monotonic()
        try:
            caps = " ".join(f for f in extra_cflags if f.startswith("-m") or f.startswith("-DCPU_CAPABILITY="))
            _say(f"building the native CPU library {name}{f' [{caps}]' if caps else ''} in {folder} "
                 f"(about a minute, once per version)...")
            library = _compile_and_link(name, sources, include_dirs, extra_cflags, extra_ldflags, compiler[0], tmp,
                                        verbose)
            folder.mkdir(exist_ok=True)
            os.replace(tmp / "build.log", folder / "build.log")
            os.replace(library, final)
            _say(f"built {name} in {time.monotonic() - start:.1f} s ({final})")
        except BaseException:
            _say(f"building {name} failed after {time.monotonic() - start:.1f} s (nothing was cached)")
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final
    finally:
        os.close(fd)  # releases the flock
