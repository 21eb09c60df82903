"""Shared fixtures: every backend runs the same parametrised suite.

``backend`` is parametrised over all registered backends (CPU tensors); ``backend_device`` over
``(backend, device)`` pairs: ids ``reference-cpu``, ``cpu-cpu``, ``triton-cpu`` and, when there is a CUDA device,
``triton-cuda`` and ``reference-cuda`` (:mod:`_support.devices`, whose ``on_device`` moves a case's inputs). A
backend that is unavailable is skipped with its reason, unless ``QKVFUSE_REQUIRE_BACKENDS`` (comma-separated, set
by ``make test``) names it: then it fails, so CI cannot silently stop testing a backend.
"""

import os
import sys
from pathlib import Path

# Triton kernels run on CPU tensors through the interpreter; it must be on before triton is imported. It only
# matters for Triton on CPU tensors (``triton-cpu``); run with TRITON_INTERPRET=0 to test ``triton-cuda``.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Test helpers live in tests/_support (``from _support.x import y``): put tests/ on sys.path whatever pytest's
# import mode, so it works from any directory and in a fresh clone.
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

import pytest  # noqa: E402
import torch  # noqa: E402

from _support.devices import BackendDevice, pair_id, pairs, unsupported  # noqa: E402
from qkvfuse.backends import BACKEND_NAMES, backend_unavailable  # noqa: E402

REQUIRED = {b for b in os.environ.get("QKVFUSE_REQUIRE_BACKENDS", "").split(",") if b}


def _backend_or_skip(name: str) -> str:
    reason = backend_unavailable(name)
    if reason:
        if name in REQUIRED:
            pytest.fail(f"backend {name!r} is required (QKVFUSE_REQUIRE_BACKENDS) but unavailable: {reason}")
        pytest.skip(f"backend {name!r} unavailable: {reason}")
    return name


@pytest.fixture(params=BACKEND_NAMES)
def backend(request) -> str:
    """Name of a backend to test on CPU tensors (triton runs under TRITON_INTERPRET=1)."""
    return _backend_or_skip(request.param)


@pytest.fixture(params=[b for b in BACKEND_NAMES if b != "reference"])
def fast_backend(request) -> str:
    """A non-reference backend (for tests comparing a fast path with the reference)."""
    return _backend_or_skip(request.param)


@pytest.fixture(params=pairs(BACKEND_NAMES), ids=pair_id)
def backend_device(request) -> BackendDevice:
    """A ``(backend, device)`` pair: tensors on ``.device``, ops called with ``backend=.backend``."""
    pair = request.param
    reason = unsupported(pair)
    if reason:
        pytest.skip(f"{pair_id(pair)}: {reason}")
    _backend_or_skip(pair.backend)
    return pair


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
