"""MoE helpers: shared-expert overlap on a side stream, and its GLM-4 MoE integration.

* :class:`SharedExpertOverlap` -- runs ``combine(routed_fn(x), shared_fn(x))`` with the shared expert on a
  lazily created side stream (cuda/xpu/npu), inline and bitwise identical elsewhere; see :mod:`.overlap` for
  when it helps and the exact synchronisation protocol.
* :func:`patch_glm4_moe` / :func:`unpatch_glm4_moe` -- route a transformers GLM-4 MoE block through it.
* ``QKVFUSE_SHARED_EXPERT_OVERLAP=1`` turns the overlap on where no explicit argument is given (default off).
"""

from .glm4 import GLM4_MOE_BLOCK_CLASSES, is_glm4_moe_block, patch_glm4_moe, unpatch_glm4_moe
from .overlap import ENV_VAR, STREAM_DEVICE_TYPES, SharedExpertOverlap, overlap_enabled

__all__ = [
    "SharedExpertOverlap",
    "overlap_enabled",
    "ENV_VAR",
    "STREAM_DEVICE_TYPES",
    "patch_glm4_moe",
    "unpatch_glm4_moe",
    "is_glm4_moe_block",
    "GLM4_MOE_BLOCK_CLASSES",
]
