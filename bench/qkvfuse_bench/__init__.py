"""qkvfuse's research and maintainer benchmarks: outside the package, never installed, never imported by it.

Run from the repository root with ``bench/`` on the path (the Makefile targets do), each in its venv:

* :mod:`.vllm` -- against vLLM-CPU's C ops and zentorch, and whole vLLM engines plugin on / off
  (``make bench-vllm``; ``PYTHONPATH=bench .venv-vllm/bin/python -m qkvfuse_bench.vllm``);
* :mod:`.sglang` -- whole SGLang engines plugin on / off (``make bench-sglang``);
* :mod:`.e2e` -- whole transformers models, patched vs unpatched (``PYTHONPATH=bench .venv/bin/python -m
  qkvfuse_bench.e2e``);
* :mod:`.percall` -- the per-call cost at T = 1, bound objects and functional ops against bare ``torch.ops`` calls
  (``PYTHONPATH=bench .venv/bin/python -m qkvfuse_bench.percall``; a section of the package's bench runner);
* :mod:`.targets` -- the team's speed, overhead and per-call targets judged on a bench run (``make bench-targets``).

They build on the package's quick op bench (:mod:`qkvfuse.benchmarks`: timing, the op matrix, the report) and
verification code; the package keeps ``python -m qkvfuse bench``. How to run and read them: ``bench/README.md``.
"""
