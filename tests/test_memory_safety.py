"""Memory safety: every backend run with all inputs and outputs placed flush against inaccessible pages.

``qkvfuse._verify.guarded`` puts each tensor in its own mapping, ending (or starting) exactly at a
``PROT_NONE`` page, so one byte read or written out of bounds is a segmentation fault. The edge cases (T=1,
odd head counts, head_dim 2/80/96/192/512, partial rotary, positions 0 and max_position - 1, strided rows,
stride-0 mRoPE rows, in-place, both ops; the cache-writing split with each KV-cache layout's first and last slot
written) run in one child process per backend; a crash fails the case it
happened in, and every guarded result must equal the same call on ordinary memory.
"""

import signal
import subprocess
import sys
import textwrap

import pytest
from _support.child_records import assert_child_call_ok, child_records

from qkvfuse._verify import guarded

def _results(backend):
    """``(results by call name, exit code, call that was running when the child died, stderr tail)``."""
    return child_records("qkvfuse._verify.guarded", backend)


@pytest.mark.parametrize("case", guarded.case_ids())
def test_guarded_edge_case(backend, case):
    reason = guarded.skip_reason(case, backend)
    if reason:
        pytest.skip(reason)
    assert_child_call_ok(_results(backend), case)


@pytest.mark.parametrize("align,offset", [("end", 0), ("start", -1)])
def test_guard_page_really_faults(align, offset):
    """The harness itself: touching the byte just past the tensor (before it, for align=start) crashes."""
    code = textwrap.dedent(f"""
        import ctypes, torch
        from qkvfuse._verify.guarded import guarded_copy
        t = guarded_copy(torch.arange(12, dtype=torch.float32).view(3, 4), {align!r}, row_pad=5)
        assert t.tolist() == torch.arange(12.0).view(3, 4).tolist() and t.stride() == (9, 1)
        edge = t.data_ptr() + ((2 * 9 + 3 + 1) * 4 if {offset} == 0 else -1)
        print("touching", flush=True)
        ctypes.c_char.from_address(edge).value
        print("survived", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "touching" in proc.stdout, proc.stderr
    assert "survived" not in proc.stdout and proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stderr)
