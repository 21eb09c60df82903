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


_GATED_REFUSALS: dict = {}


def _gated_refusal(backend) -> str:
    """Why ``backend`` (None: what the public ops pick on CPU) cannot run the gated Q layout yet, or ''."""
    if backend not in _GATED_REFUSALS:
        import torch

        from qkvfuse.rope import build_cos_sin_cache

        table = build_cos_sin_cache(64, 4, 1e7, {"rope_type": "default", "rope_theta": 1e7}, dtype=torch.float32)
        reason = ""
        try:
            qkvfuse.split_qkv_rmsnorm_rope(torch.randn(2, 6 * 64), torch.arange(2), table, 2, 1, 64, q_gate=True,
                                           gemma_norm=True, backend=backend)
        except Exception as exc:  # anything else (an unavailable backend) is the test's own to report
            if isinstance(exc, NotImplementedError) or "not implemented by this build yet" in str(exc):
                reason = str(exc)
        _GATED_REFUSALS[backend] = reason
    return _GATED_REFUSALS[backend]


@pytest.fixture(autouse=True)
def _gated_families_need_a_gated_kernel(request):
    """A tiny gated-attention model (Qwen3-Next, Qwen3.5) on a backend whose gated kernel has not landed yet
    (the native CPU and Triton kernels, issue 22) is skipped with the backend's own message, rather than failing
    the family's tests; they run as soon as the kernel does (QKVFUSE_BACKEND=reference runs them today)."""
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    name = params.get("name")
    if not isinstance(name, str):
        return
    from qkvfuse._verify.tiny_models import TINY_MODELS

    spec = TINY_MODELS.get(name)
    if spec is None or not spec.gated:
        return
    reason = _gated_refusal(params.get("backend", params.get("fast_backend")))
    if reason:
        pytest.skip(f"{name}: {reason}")
