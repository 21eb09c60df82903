"""Progress of the main job's long steps: a tqdm bar on a terminal, one plain line per step otherwise.

A terminal gets a bar per step (count, rate and time left; cleared when the step ends, so the summary screen is
what stays). Anything else (a CI log, a pipe) gets at most one line per step, written when the step ends, on
stderr: stdout holds the summary alone. ``quiet`` shows nothing.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

__all__ = ["Progress", "progress_mode"]


def progress_mode(quiet: bool, stream: Optional[TextIO] = None) -> str:
    """``"quiet"``, ``"bar"`` (stdout is a terminal and tqdm is importable) or ``"plain"``."""
    if quiet:
        return "quiet"
    stream = stream if stream is not None else sys.stdout
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return "plain"
    try:
        import tqdm  # noqa: F401  (installed with transformers; a bare install prints plain lines)
    except ImportError:
        return "plain"
    return "bar"


class Progress:
    """One step at a time: :meth:`start`, then :meth:`planned` / :meth:`advance`, then :meth:`end`. Also the
    progress object of :func:`qkvfuse._verify.sections.collect` (its ``start(name, summary)`` and
    ``end(name, section, seconds)`` name a verify section)."""

    def __init__(self, mode: str, prefix: str = "", stream: Optional[TextIO] = None):
        self.mode, self.prefix = mode, prefix
        self.stream = stream if stream is not None else sys.stderr
        self._bar = None
        self._name = ""
        self._done = self._total = 0
        self._t0 = 0.0

    def start(self, name: str, summary: str = "", total: Optional[int] = None, unit: str = "check") -> None:
        """Begin step ``name`` (``total`` units when known; a verify section announces its checks as it goes)."""
        self.close()
        self._name, self._done, self._total, self._t0 = name, 0, total or 0, time.perf_counter()
        if self.mode == "bar":
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=f"{self.prefix}{name}", unit=f" {unit}",
                             leave=False, file=self.stream, dynamic_ncols=True)

    def planned(self, n: int) -> None:
        """``n`` more units in this step."""
        self._total += n
        if self._bar is not None:
            self._bar.total = self._total
            self._bar.refresh()

    def advance(self, n: int = 1) -> None:
        """``n`` units done."""
        self._done += n
        if self._bar is not None:
            self._bar.update(n)

    def end(self, name: str = "", section=None, seconds: Optional[float] = None, line: str = "") -> None:
        """End the step; the plain mode writes its one line (``line``, or a count and the time)."""
        seconds = time.perf_counter() - self._t0 if seconds is None else seconds
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self.mode == "plain":
            if not line:
                counted = f"{self._done}/{self._total} " if self._total else ""
                failed = getattr(section, "failures", 0)
                line = f"{counted}done in {seconds:.1f} s" + (f", {failed} failed" if failed else "")
            print(f"{self.prefix}{name or self._name}: {line}", file=self.stream, flush=True)
        self._name = ""

    def close(self) -> None:
        """Clear a bar left open (an exception between start and end)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
