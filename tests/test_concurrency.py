"""Concurrency and determinism: identical bits whatever the threading.

* 4 Python threads calling the ops (the split, add_rmsnorm, the cache-writing split into its own KV cache) on
  different inputs at the same time give the bits of serial calls;
* repeated calls on the same inputs give identical bits;
* 1 vs 2 intra-op threads (``torch.set_num_threads``) give identical bits, at a T large enough to be split.

The checks live in ``qkvfuse._verify.failure_modes`` (the verify section runs them too).
"""

import pytest
import torch

import qkvfuse._verify.failure_modes as fm


def test_four_threads_match_serial(backend):
    reason = fm.concurrency_unsupported(backend)
    if reason:
        pytest.skip(reason)
    fm.check_concurrent_threads(backend, threads=4)


def test_repeated_calls_identical(backend):
    fm.check_repeatable(backend)


def test_one_vs_two_intra_op_threads(backend):
    before = torch.get_num_threads()
    fm.check_intra_op_threads(backend)
    assert torch.get_num_threads() == before, "the check must restore the thread count"
