"""Shared fixtures: every backend runs the same parametrised suite.

``backend`` is parametrised over all registered backends. A backend that is unavailable is skipped with its
reason, unless ``QKVFUSE_REQUIRE_BACKENDS`` (comma-separated, set by ``make test``) names it: then it fails,
so CI cannot silently stop testing a backend.
"""

import os

# Triton kernels run on CPU tensors through the interpreter; it must be on before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from qkvfuse.backends import BACKEND_NAMES, available_backends

REQUIRED = {b for b in os.environ.get("QKVFUSE_REQUIRE_BACKENDS", "").split(",") if b}


def _backend_or_skip(name: str) -> str:
    reason = available_backends()[name]
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


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
