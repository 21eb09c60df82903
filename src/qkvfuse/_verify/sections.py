"""The section protocol of ``python -m qkvfuse verify``, the registry of sections, and the runner.

A section is a function ``section(opts: Options) -> Section`` (or ``None`` when it has nothing to do in this
run) named in :data:`REGISTRY` by ``"module:function"``, imported only when it runs. Host sections check every
backend on CPU tensors (Triton under ``TRITON_INTERPRET=1``); device sections check the Triton backend on
``opts.device`` at realistic sizes. ``--cpu-interpreter`` runs the device sections on CPU tensors at small sizes
under the interpreter, a dry run that keeps them from rotting on machines without an accelerator.

A section whose dependencies are missing reports that in its note instead of failing; a section that raises is
one failed row. The exit status is non-zero if any row fails.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import platform
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional, Sequence

__all__ = ["Section", "Options", "Entry", "REGISTRY", "print_section", "sections_for", "load", "run", "collect",
           "Verified", "failed_checks", "rerun_command", "planned", "advance", "backends_section",
           "triton_interpreter"]


@dataclasses.dataclass
class Section:
    """One table: ``rows`` are dicts keyed by ``columns``; each row has a boolean ``pass`` column."""

    title: str
    columns: Sequence[str]
    rows: List[Dict[str, object]]
    note: str = ""

    @property
    def failures(self) -> int:
        """Rows that did not pass; a row with ``"pass": None`` is skipped (shown as SKIP, not a failure)."""
        return sum(1 for r in self.rows if r.get("pass", False) is not None and not r.get("pass", False))


@dataclasses.dataclass
class Options:
    """What one ``verify`` (or device ``bench``) run covers.

    ``device``: where the device sections run (``"cpu"``: the host sections run instead). ``cpu_interpreter``:
    the device sections on CPU tensors at small sizes, Triton under ``TRITON_INTERPRET=1``.
    """

    quick: bool = False
    backends: Optional[Sequence[str]] = None
    sections: Optional[Sequence[str]] = None
    device: str = "cpu"
    cpu_interpreter: bool = False
    json: Optional[str] = None

    @property
    def device_run(self) -> bool:
        """Whether this run is of the device sections."""
        return self.cpu_interpreter or self.device != "cpu"

    @property
    def tier(self) -> str:
        """Sizes of the device sections: ``"cpu"`` (interpreter dry run), ``"quick"`` or ``"full"``."""
        return "cpu" if self.cpu_interpreter else ("quick" if self.quick else "full")

    @property
    def torch_device(self):
        import torch

        return torch.device("cpu") if self.cpu_interpreter else torch.device(self.device)


@dataclasses.dataclass(frozen=True)
class Entry:
    target: str  # "module:function"
    device: bool  # a device section (runs with --device <accelerator> or --cpu-interpreter)
    summary: str
    backends: bool = False  # checks the host backends: a "backends" table (which can run here) goes first


REGISTRY: Dict[str, Entry] = {
    "ops": Entry("qkvfuse._verify.conformance:ops_section", False,
                 "every preset's prepare step and add_rmsnorm, per backend, vs the float64 oracle", True),
    "models": Entry("qkvfuse._verify.models:section", False,
                    "tiny transformers models patched vs unpatched, logits to logits", True),
    "failure-modes": Entry("qkvfuse._verify.failure_modes:section", False,
                           "public failure modes of fused kernels, bad input, fuzz-lite, determinism", True),
    "conformance": Entry("qkvfuse._verify.device:conformance_section", True,
                         "Triton at realistic sizes vs the float64 oracle"),
    "stability": Entry("qkvfuse._verify.device:stability_section", True,
                       "determinism, no recompilation, CUDA-graph capture, torch.compile"),
    "moe-streams": Entry("qkvfuse._verify.moe_streams:section", True,
                         "shared-expert overlap on a side stream: race check and timings (CUDA)"),
}


def triton_interpreter() -> str:
    """Turn Triton's CPU interpreter on for this process: "" when it is on, else why it cannot be any more.

    ``TRITON_INTERPRET`` is read when ``triton`` (whose ``triton.language`` defines @jit helpers of its own) and the
    kernels are imported: set later, it gives a mix of interpreted and compiled functions that fails at the first
    launch, so once triton is imported without it the interpreter is out of reach for this process.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        return ""
    if "triton" in sys.modules:
        return ("triton was imported before TRITON_INTERPRET=1 could be set; run with TRITON_INTERPRET=1 in the "
                "environment for Triton on CPU tensors")
    os.environ["TRITON_INTERPRET"] = "1"
    return ""


def sections_for(opts: Options) -> List[str]:
    """Names of the registered sections of this kind of run (host or device), in registry order."""
    return [name for name, entry in REGISTRY.items() if entry.device == opts.device_run]


def load(name: str) -> Callable[[Options], Optional[Section]]:
    module, func = REGISTRY[name].target.split(":")
    return getattr(importlib.import_module(module), func)


def _fmt(value) -> str:
    if value is None:
        return "SKIP"
    if isinstance(value, bool):
        return "PASS" if value else "FAIL"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def print_section(section: Section) -> None:
    cells = [[_fmt(r.get(c, "")) for c in section.columns] for r in section.rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(section.columns)]
    print(f"\n== {section.title} ==")
    if section.note:
        print(section.note)
    print("  ".join(c.ljust(w) for c, w in zip(section.columns, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
    for row in section.rows:
        if row.get("pass", False) is not None and not row.get("pass", False) and row.get("detail"):
            print(f"  FAIL detail: {row['detail']}")


def header(opts: Options) -> Dict[str, object]:
    """The run's first line: what ran where (device name, versions)."""
    import torch

    device = opts.torch_device
    name = str(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    info: Dict[str, object] = dict(mode="cpu-interpreter" if opts.cpu_interpreter else
                                   ("device" if opts.device_run else "host"),
                                   device=name, torch=torch.__version__, python=platform.python_version())
    if opts.device_run:
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError as exc:
            info["triton"] = f"unavailable ({exc})"
        info["tier"] = opts.tier
    return info


def _failed(name: str, exc: BaseException) -> Section:
    return Section(name, ("check", "pass"), [{"check": name, "pass": False,
                                              "detail": f"{type(exc).__name__}: {exc}"}])


def backends_section(opts: Options) -> Section:
    """Whether each backend of this host run can run here, with the reason when it cannot: a requested
    (``--backend``) backend that cannot run is a failed row, any other a skipped one (the sections leave it out)."""
    from ..backends import BACKEND_NAMES, available_backends

    no_interpreter = triton_interpreter()  # before anything imports triton (see triton_interpreter)
    try:
        reasons = dict(available_backends())
    except Exception as exc:  # noqa: BLE001 -- a reason, not a traceback
        reasons = {name: f"{type(exc).__name__}: {exc}" for name in BACKEND_NAMES}
    if no_interpreter and not reasons.get("triton"):
        reasons["triton"] = no_interpreter
    rows = []
    for name in BACKEND_NAMES:
        requested = bool(opts.backends) and name in opts.backends
        if opts.backends and not requested:
            continue
        reason = reasons.get(name, "")
        rows.append({"backend": name, "status": "unavailable" if reason else "available",
                     "pass": True if not reason else (False if requested else None), "detail": reason})
    note = "a requested backend that cannot run fails; otherwise an unavailable backend is skipped"
    skipped = [r for r in rows if r["pass"] is None]
    if skipped:
        note += "\n" + "\n".join(f"skipped {r['backend']}: {r['detail']}" for r in skipped)
    return Section("backends", ("backend", "status", "pass"), rows, note)


# A section reports its work as it goes (:func:`planned` before, :func:`advance` per check) so that a caller can
# show progress; nothing happens unless :func:`collect` was given a progress object.
_progress = None


def planned(n: int) -> None:
    """The running section will make ``n`` more checks (adds to its progress total; may be called again)."""
    if _progress is not None and n:
        _progress.planned(n)


def advance(n: int = 1) -> None:
    """The running section finished ``n`` more checks."""
    if _progress is not None and n:
        _progress.advance(n)


@dataclasses.dataclass
class Verified:
    """What :func:`collect` returns: the header, each section run (name, table, seconds), the exit status
    (0 all passed, 1 a row failed, 2 bad options: ``error`` says which) and the JSON-ready ``result``."""

    info: Dict[str, object]
    sections: List[tuple]  # (name, Section, seconds)
    code: int
    result: Dict[str, object]
    error: str = ""
    seconds: float = 0.0

    @property
    def counts(self) -> Dict[str, int]:
        """passed / failed / skipped rows over every section."""
        rows = [r for _, s, _ in self.sections for r in s.rows]
        failed = sum(s.failures for _, s, _ in self.sections)
        checked = sum(r.get("pass", False) is not None for r in rows)
        return {"passed": checked - failed, "failed": failed,
                "skipped": sum(r.get("pass", False) is None for r in rows)}


# Columns that measure a row rather than name it (left out of a failed row's name).
_MEASURES = {"pass", "max err", "unfused err", "s", "passed", "total", "max logit err", "unpatched err",
             "tokens identical", "status", "detail"}


def failed_checks(name: str, section: Section) -> List[Dict[str, str]]:
    """Each failed row of ``section`` (registered as ``name``): ``{"name", "detail", "rerun"}``, the name made of
    the row's identifying columns, the rerun the command that runs that section (and backend) alone."""
    out = []
    for row in section.rows:
        if row.get("pass", False) is None or row.get("pass", False):
            continue
        label = " ".join(str(row[c]) for c in section.columns if c not in _MEASURES and row.get(c) not in (None, ""))
        backend = row.get("backend")
        out.append({"name": f"{name}: {label}" if label else name, "detail": str(row.get("detail", "")),
                    "rerun": rerun_command(name, backend if isinstance(backend, str) else None)})
    return out


def rerun_command(section: str, backend: Optional[str] = None) -> str:
    """The command that reruns one host section (the ``backends`` table: every section) for one backend."""
    command = "python -m qkvfuse verify"
    if section in REGISTRY:
        command += f" --section {section}"
    return command + (f" --backend {backend}" if backend else "")


def collect(opts: Options, progress=None, echo: bool = False) -> Verified:
    """Run the sections of ``opts`` (host or device) and return them; ``echo`` prints each table as it finishes.

    ``progress``: an object with ``start(name, summary)``, ``planned(n)``, ``advance(n)`` and
    ``end(name, section, seconds)`` (see :func:`planned`). The JSON (``opts.json``) is rewritten after every
    section, so a run cut short keeps its results.
    """
    global _progress

    def refuse(message: str) -> Verified:
        if echo:
            print(message)
        return Verified({}, [], 2, {}, error=message)

    if opts.cpu_interpreter:
        reason = triton_interpreter()
        if reason:
            return refuse(f"verify: --cpu-interpreter: {reason}")
    if opts.backends:
        from ..backends import BACKEND_NAMES

        unknown = [b for b in opts.backends if b not in BACKEND_NAMES]
        if unknown:
            return refuse(f"verify: --backend {', '.join(unknown)}: not a backend; choose from "
                          f"{', '.join(BACKEND_NAMES)}")
    names = sections_for(opts)
    if opts.sections:
        unknown = [s for s in opts.sections if s not in names]
        if unknown:
            kind = "device run (--device <accelerator> or --cpu-interpreter)" if opts.device_run else "host run"
            return refuse(f"verify: --section {', '.join(unknown)}: not a section of this {kind}; "
                          f"choose from {', '.join(names)}")
        names = [n for n in names if n in opts.sections]
    info = header(opts)
    if echo:
        print(json.dumps(info))
    result: Dict[str, object] = dict(info, sections=[])
    done = Verified(info, [], 0, result)
    start = time.perf_counter()

    def record(name: str, section: Section, t0: float) -> None:
        seconds = time.perf_counter() - t0
        if echo:
            print_section(section)
        if progress is not None:
            progress.end(name, section, seconds)
        done.sections.append((name, section, seconds))
        result["sections"].append(dict(dataclasses.asdict(section), name=name, seconds=round(seconds, 1)))
        result["elapsed_s"] = round(time.perf_counter() - start, 1)
        if opts.json:
            with open(opts.json, "w") as fh:
                json.dump(result, fh, indent=1, default=str)

    if not opts.device_run and any(REGISTRY[n].backends for n in names):  # which backends can run, first
        t0 = time.perf_counter()
        if progress is not None:
            progress.start("backends", "which backends can run here")
        section = backends_section(opts)
        record("backends", section, t0)
        if opts.backends:  # the sections get the requested backends that can run
            runnable = [r["backend"] for r in section.rows if r["pass"]]
            if not runnable:
                if echo:
                    print("\nverify: no requested backend can run here; the sections that check backends are skipped")
                names = [n for n in names if not REGISTRY[n].backends]
            opts = dataclasses.replace(opts, backends=runnable)
    for name in names:
        t0 = time.perf_counter()
        try:
            section_fn = load(name)
        except ImportError as exc:
            if echo:
                print(f"\n== {name} == skipped: {exc}")
            continue
        if progress is not None:
            progress.start(name, REGISTRY[name].summary)
        _progress = progress
        try:
            section = section_fn(opts)
            if opts.device_run and opts.torch_device.type != "cpu":  # an asynchronous error belongs to this section
                import torch

                torch.get_device_module(opts.torch_device).synchronize()
        except Exception as exc:  # one broken section must not hide the others' results
            traceback.print_exc()
            section = _failed(name, exc)
        finally:
            _progress = None
        if section is None:  # nothing to do in this run (e.g. a full-tier-only section)
            if progress is not None:
                progress.end(name, None, time.perf_counter() - t0)
            continue
        record(name, section, t0)
    done.seconds = time.perf_counter() - start
    done.code = 1 if done.counts["failed"] else 0
    return done


def run(opts: Options) -> int:
    """Run the sections of ``opts`` (host or device), print each table, return 1 if any row failed (2: bad
    options). The JSON (``opts.json``) is rewritten after every section, so a run cut short keeps its results."""
    done = collect(opts, echo=True)
    if done.code == 2:
        return 2
    counts = done.counts
    print(f"\nverify: {counts['passed']} passed, {counts['failed']} failed"
          + (f", {counts['skipped']} skipped" if counts["skipped"] else "") + f" in {done.seconds:.0f} s"
          + (f"; JSON: {opts.json}" if opts.json else ""))
    return done.code
