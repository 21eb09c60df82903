"""Shared-expert overlap for the GLM-4 MoE block of transformers (``Glm4MoeMoE`` and its twins).

transformers computes the block as (``modeling_glm4_moe.Glm4MoeMoE.forward``)::

    _, topk_weights, topk_indices = self.gate(hidden)            # fp32 sigmoid router
    routed = self.experts(hidden.view(-1, H), topk_indices, topk_weights).view(*hidden.shape)
    return routed + self.shared_experts(hidden)                   # shared expert added on top

:func:`patch_glm4_moe` replaces the block's ``forward`` with the same three module calls made through
:class:`~qkvfuse.moe.overlap.SharedExpertOverlap`: shared expert on a side stream, router and routed experts
on the current stream, the sum on the current stream after the join. The calls go through the submodules
(``self.gate(...)``), so their hooks -- the router-logit recorder included -- still fire, and whatever
``experts_implementation`` the config selects (``eager``, ``grouped_mm``, ...) is still used. With overlap off,
or on CPU, the result is bitwise that of the original forward.

Nothing here imports transformers: blocks are recognised by class name and by their three submodules.
"""

from __future__ import annotations

import types
from typing import Optional

import torch
from torch import nn

from .overlap import SharedExpertOverlap, overlap_enabled, process_runner

__all__ = ["GLM4_MOE_BLOCK_CLASSES", "is_glm4_moe_block", "patch_glm4_moe", "unpatch_glm4_moe"]

# transformers classes whose forward is exactly the three calls above (GLM-4.5/4.6/4.7, GLM-4.5V text, lite).
GLM4_MOE_BLOCK_CLASSES = ("Glm4MoeMoE", "Glm4vMoeTextMoE", "Glm4MoeLiteMoE")

_RUNNER_ATTR = "_qkvfuse_shared_expert_overlap"
_INLINE = SharedExpertOverlap(enabled=False)


def is_glm4_moe_block(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers GLM-4 MoE block that :func:`patch_glm4_moe` accepts."""
    return type(module).__name__ in GLM4_MOE_BLOCK_CLASSES and all(
        isinstance(getattr(module, name, None), nn.Module) for name in ("gate", "experts", "shared_experts")
    )


def _overlapped_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    orig_shape = hidden_states.shape

    def routed(hidden: torch.Tensor) -> torch.Tensor:
        _, topk_weights, topk_indices = self.gate(hidden)
        flat = hidden.view(-1, hidden.shape[-1])
        return self.experts(flat, topk_indices, topk_weights).view(*orig_shape)

    return getattr(self, _RUNNER_ATTR).run(hidden_states, self.shared_experts, routed)


def patch_glm4_moe(moe_module: nn.Module, overlap: Optional[bool] = None, *,
                   runner: Optional[SharedExpertOverlap] = None) -> None:
    """Make a GLM-4 MoE block run its shared expert through the overlap helper (in place).

    Parameters
    ----------
    moe_module : torch.nn.Module
        A ``Glm4MoeMoE`` (GLM-4.5/4.6/4.7), ``Glm4vMoeTextMoE`` (GLM-4.5V text) or ``Glm4MoeLiteMoE`` instance,
        i.e. ``decoder_layer.mlp`` of a layer at index ``>= config.first_k_dense_replace``. Input of its
        forward: hidden states ``[..., hidden_size]`` in the model dtype; output: same shape and dtype.
    overlap : bool or None
        Run the shared expert on a side stream (cuda/xpu/npu tensors only). ``None`` reads
        ``QKVFUSE_SHARED_EXPERT_OVERLAP`` now (default off). Off, the patched forward is bitwise the original.
    runner : SharedExpertOverlap or None
        Helper to use when ``overlap`` is on; default: one process-wide helper shared by all patched blocks.

    Patching a patched block again replaces its setting; :func:`unpatch_glm4_moe` restores the original.
    """
    if not is_glm4_moe_block(moe_module):
        raise TypeError(
            f"moe_module must be one of the transformers GLM-4 MoE blocks {GLM4_MOE_BLOCK_CLASSES} with gate, "
            f"experts and shared_experts submodules, got {type(moe_module).__name__}"
        )
    if runner is not None and not isinstance(runner, SharedExpertOverlap):
        raise TypeError(f"runner must be a SharedExpertOverlap or None, got {type(runner).__name__}")
    if overlap_enabled(overlap):
        chosen = runner if runner is not None else process_runner()
    else:
        chosen = _INLINE
    # Plain attributes, not submodules: the helper holds no weights and must stay out of state_dict.
    moe_module.__dict__[_RUNNER_ATTR] = chosen
    moe_module.forward = types.MethodType(_overlapped_forward, moe_module)


def unpatch_glm4_moe(moe_module: nn.Module) -> bool:
    """Restore the transformers forward of a block patched by :func:`patch_glm4_moe`.

    Returns ``True`` if the block was patched, ``False`` if there was nothing to undo.
    """
    if _RUNNER_ATTR not in moe_module.__dict__:
        return False
    del moe_module.__dict__[_RUNNER_ATTR]
    moe_module.__dict__.pop("forward", None)
    return True
