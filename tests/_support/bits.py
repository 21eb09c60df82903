"""Bitwise comparison of op outputs (the contract tests' notion of "the same result")."""

import torch

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
             torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def assert_bitwise(got, want):
    """Every output has the same shape, dtype and bits (NaNs included) as its counterpart."""
    got, want = tuple(got), tuple(want)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype), f"output {i}"
        assert torch.equal(a.view(_INT_VIEW[a.dtype]), b.view(_INT_VIEW[b.dtype])), f"output {i} differs"
