"""``python -m qkvfuse [run|verify|bench|build]``: check and measure qkvfuse on this machine.

With no sub-command (or ``run``; what ``make run`` calls): build the native library, verify every backend, time
the user-facing calls against the alternatives, print one screen and write the full report
(:mod:`qkvfuse.cli.run`). ``verify`` and ``bench`` print every table; ``build`` builds and prints the library's
path. ``--device cuda`` (verify, bench) checks / times the Triton backend on that device; ``--cpu-interpreter`` is
a dry run of those on CPU (small sizes, ``TRITON_INTERPRET=1``). Documented in ``docs/cli.md``.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence


def main(argv: Optional[List[str]] = None, *, bench_sections: Sequence = ()) -> int:
    """Run the command line; ``bench_sections``: the extra ``bench`` sections of the harnesses outside the package
    (:func:`qkvfuse.benchmarks.run_bench`), which call this with them."""
    from .._verify.sections import REGISTRY
    from ..backends import BACKEND_NAMES
    from .run import DEFAULT_REPORT_DIR

    parser = argparse.ArgumentParser(prog="qkvfuse", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="the main job (the default): build, verify, time, one screen and a report "
                                     "folder; exit 0 only when everything verified")
    run.add_argument("--report", default=DEFAULT_REPORT_DIR,
                     help=f"folder of the full report (default ./{DEFAULT_REPORT_DIR}/: report.md, report.json, "
                          "speed.png, accuracy.png)")
    run.add_argument("--json", help="also write the report's JSON to this path")
    run.add_argument("--quiet", action="store_true", help="no progress: print the summary only")
    run.add_argument("--quick", action="store_true", help="verify fewer rows (CI-sized)")
    run.add_argument("--backend", action="append", choices=BACKEND_NAMES,
                     help="verify only these backends (repeatable); one that cannot run here fails the run")
    run.add_argument("--tokens", action="append", type=int,
                     help="time only these token counts (default 1, 16, 256, 4096)")
    run.add_argument("--seconds", type=float, help="about this many seconds per timed cell (default about 1)")
    run.add_argument("--no-compile", action="store_true", help="leave out the torch.compile column")
    run.add_argument("--no-bench", action="store_true", help="verify only: no speed table")
    run.add_argument("--threads", type=int, help="torch.set_num_threads(N) first (default: torch's choice)")
    verify = sub.add_parser("verify", help="verify every backend against the float64 oracle (non-zero exit on failure)")
    verify.add_argument("--quick", action="store_true", help="fewer rows (CI-sized)")
    verify.add_argument("--backend", action="append", choices=BACKEND_NAMES,
                        help="only these backends (repeatable); a requested backend that cannot run here is a "
                             "failed row with its reason")
    verify.add_argument("--section", action="append", choices=list(REGISTRY),
                        help="only these sections (repeatable): ops, models, failure-modes; with --device cuda or "
                             "--cpu-interpreter: conformance, stability, moe-streams")
    verify.add_argument("--json", help="also write the rows as JSON to this path (rewritten after every section; "
                                       "an unwritable path is an error before anything runs)")
    _device_arguments(verify)
    bench = sub.add_parser("bench", help="benchmark the fused ops against eager, torch.compile and a copy roofline")
    bench.add_argument("--quick", action="store_true", help="a short run (also the maintainers' `make bench-targets`)")
    bench.add_argument("--json", help="write the table as JSON to this path (an unwritable path is an error "
                                      "before anything runs)")
    bench.add_argument("--plot", help="write a PNG chart to this path (needs matplotlib; without it, or with an "
                                      "unwritable path, an error before anything runs; if the chart still cannot "
                                      "be written after the run, the tables and summary are printed, then the "
                                      "error, and the exit status is 1)")
    bench.add_argument("--preset", action="append", help="only these presets (repeatable)")
    bench.add_argument("--dtype", action="append", choices=["bf16", "fp32", "fp16"], help="only these dtypes")
    bench.add_argument("--tokens", action="append", type=int, help="only these token counts")
    bench.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    bench.add_argument("--op", action="append", choices=["split", "norm", "percall"],
                       help="only these sections (repeatable): split, norm (the T tables); percall (T=1 per-call "
                            "cost) runs from a checkout's bench/ folder (bench/README.md)")
    bench.add_argument("--hidden", action="append", type=int, help="add_rmsnorm hidden sizes (default 4096, 5120)")
    bench.add_argument("--seconds", type=float, help="about this many seconds per measurement (rounds adapt)")
    bench.add_argument("--threads", type=int, help="torch.set_num_threads(N) first (default: torch's choice)")
    # End to end moved to the repository's bench/ folder: the flags remain to say where (not in the help).
    bench.add_argument("--e2e", action="store_true", help=argparse.SUPPRESS)
    bench.add_argument("--e2e-compile", action="store_true", help=argparse.SUPPRESS)
    bench.add_argument("--tile-sweep", action="store_true",
                       help="with --device: also sweep the Triton split kernel's tile size and warps (the full tier "
                            "always does)")
    _device_arguments(bench, " (--preset, --tokens, --quick and --json apply there too)")
    # The team's own targets, for maintainers (bench/qkvfuse_bench/targets.py): not in the user's help.
    bench.add_argument("--targets", action="store_true", help=argparse.SUPPRESS)
    sub.add_parser("build", help="build (once per version of its sources) and load the native CPU library, "
                                 "then print its path")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in sub.choices and argv[0] not in ("-h", "--help")):
        argv = ["run"] + argv  # the main job is the default sub-command
    args = parser.parse_args(argv)
    if args.command == "run":
        from .run import run_main

        return run_main(args)
    if args.command in ("verify", "bench"):
        problem = _output_problem(args)
        if problem:
            print(f"{args.command}: {problem}", file=sys.stderr)
            return 2
    if args.command == "build":
        try:
            from ..backends.cpu import prebuild

            print(prebuild())
        except Exception as exc:  # the reason in one line (the build's own stderr lines say the rest)
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            print(f"qkvfuse build: {lines[0] if lines else type(exc).__name__}", file=sys.stderr)
            return 1
        return 0
    if args.command in ("verify", "bench") and args.device != "cpu":
        from .._verify.device import device_unavailable

        reason = device_unavailable(args.device)
        if reason:
            print(f"{args.command}: --device {args.device}: {reason}", file=sys.stderr)
            return 2
    if args.command == "verify":
        from .._verify.sections import Options, run

        return run(Options(quick=args.quick, backends=args.backend, sections=args.section, device=args.device,
                           cpu_interpreter=args.cpu_interpreter, json=args.json))
    if args.device != "cpu" or args.cpu_interpreter:
        from ..benchmarks.device import run_device_bench

        return run_device_bench(args)
    from ..benchmarks import run_bench

    return run_bench(args, bench_sections)


def _output_problem(args) -> str:
    """Checks of the output flags before anything runs: the paths can be written, the chart can be drawn."""
    from ..benchmarks.report import unwritable

    for flag in ("json", "plot"):
        path = getattr(args, flag, None)
        if path:
            reason = unwritable(path)
            if reason:
                return f"--{flag} {path}: {reason}"
    if getattr(args, "plot", None):
        from ..benchmarks.report import matplotlib_unavailable

        reason = matplotlib_unavailable()
        if reason:
            return f"--plot {args.plot}: needs matplotlib ({reason}); install it or drop --plot"
    return ""


def _device_arguments(parser: argparse.ArgumentParser, extra: str = "") -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--device", default="cpu",
                       help="cpu (default): every backend on CPU tensors; cuda (or cuda:N, xpu): the Triton backend "
                            "on that device" + extra)
    where.add_argument("--cpu-interpreter", action="store_true",
                       help="dry run of the --device sections on CPU tensors: small sizes, TRITON_INTERPRET=1")


if __name__ == "__main__":
    sys.exit(main())
