"""Fixtures shared by the transformers integration tests."""

import importlib.util

import pytest

import qkvfuse

# The vLLM tests need vLLM (make test-vllm runs them in .venv-vllm); the default suite stays vLLM-free. A spec
# without an origin is a namespace package (a folder named vllm on sys.path), not vLLM.
_VLLM = importlib.util.find_spec("vllm")
collect_ignore = [] if _VLLM is not None and _VLLM.origin is not None else ["in_vllm"]
# The same for the SGLang tests (make test-sglang, in .venv-sglang), and never the vLLM tests where "vllm" is
# the SGLang tests' stand-in (tests/_support/sglang_stubs).
_SGLANG = importlib.util.find_spec("sglang")
if _SGLANG is None or _SGLANG.origin is None:
    collect_ignore.append("in_sglang")
elif _VLLM is not None and "sglang_stubs" in (_VLLM.origin or ""):
    collect_ignore.append("in_vllm")


@pytest.fixture
def op_calls(monkeypatch):
    """Counts of the fused ops the patched model calls (proves the patch is not silently bypassed): the layers'
    bound objects' in-place prepare and add+norm calls."""
    calls = {"split": 0, "norm": 0}
    split, norm = qkvfuse.QKNormRope.inplace, qkvfuse.AddRMSNorm.__call__

    def counting_split(*args, **kwargs):
        calls["split"] += 1
        return split(*args, **kwargs)

    def counting_norm(*args, **kwargs):
        calls["norm"] += 1
        return norm(*args, **kwargs)

    monkeypatch.setattr(qkvfuse.QKNormRope, "inplace", counting_split)
    monkeypatch.setattr(qkvfuse.AddRMSNorm, "__call__", counting_norm)
    return calls

