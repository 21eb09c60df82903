"""Edits of a running vLLM model, run inside the engine by ``llm.apply_model``: what RLHF weight syncs,
sleep/offload modes and context-extension tools do. Each is deterministic (seeded), so the plugin-off and
plugin-on engines receive the same edit. Module-level functions (and partials of them), so that any executor
can ship them to its workers."""

from __future__ import annotations

import functools

import torch


def _attentions(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "rotary_emb")]


def _decoder_layers(model):
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def _fresh(t: torch.Tensor, seed: int) -> torch.Tensor:
    """New values for a norm weight, around 1 (a different set per seed), in ``t``'s dtype and device."""
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 0.5 * torch.randn(t.shape, generator=g)).to(t.dtype).to(t.device)


def _table(rot, base: float, rows=None) -> torch.Tensor:
    """A cos/sin table as ``rot`` computes it, with another rope base (and optionally fewer rows)."""
    old = rot.base
    try:
        rot.base = base
        table = rot._compute_cos_sin_cache()
    finally:
        rot.base = old
    table = table.to(rot.cos_sin_cache.dtype).to(rot.cos_sin_cache.device)
    return table[:rows].clone() if rows is not None else table


def swap_qk_norm_data(model, seed: int = 1) -> None:
    """``attn.q_norm.weight.data = new`` (and k_norm): the same Parameter objects, new storage."""
    for i, attn in enumerate(_attentions(model)):
        for j, norm in enumerate((attn.q_norm, attn.k_norm)):
            norm.weight.data = _fresh(norm.weight, seed + 10 * i + j)


def swap_layernorm_data(model, which: str = "input_layernorm", seed: int = 2) -> None:
    """``layer.<which>.weight.data = new`` on every decoder layer."""
    for i, layer in enumerate(_decoder_layers(model)):
        norm = getattr(layer, which)
        norm.weight.data = _fresh(norm.weight, seed + 10 * i)


def replace_rotary(model, base: float = 1e4) -> None:
    """``attn.rotary_emb = <a module with another table>``: a copy of the layers' rotary module (vLLM shares
    one between layers) whose table is computed with another rope base."""
    import copy

    new = {}
    for attn in _attentions(model):
        old = attn.rotary_emb
        if id(old) not in new:
            rot = copy.deepcopy(old)
            rot.base = base
            rot.cos_sin_cache = _table(rot, base)
            new[id(old)] = rot
        attn.rotary_emb = new[id(old)]


def apply_clone_then_update(model, seed: int = 3) -> None:
    """``model._apply(lambda t: t.clone())`` (what ``.to()`` / offload-reload do: new storage under every
    parameter and buffer), then in-place updates of every RMSNorm weight (a weight sync after the reload)."""
    model._apply(lambda t: t.clone())
    with torch.no_grad():
        k = 0
        for module in model.modules():
            if type(module).__name__ == "RMSNorm" and getattr(module, "weight", None) is not None:
                module.weight.mul_(_fresh(module.weight, seed + k))
                k += 1


def swap_table_data(model, base: float = 5e3, rows=None) -> None:
    """``rotary_emb.cos_sin_cache.data = new`` (same buffer object, new storage): another rope base, and with
    ``rows`` a shorter table."""
    seen = set()
    for attn in _attentions(model):
        rot = attn.rotary_emb
        if id(rot) not in seen:
            seen.add(id(rot))
            rot.cos_sin_cache.data = _table(rot, base, rows)


def fused_state(model):
    """Per attention layer the plugin fused: whether its next call takes the fused path (None: not fused)."""
    return [None if "_qkvfuse" not in a.__dict__ else a._qkvfuse.prep is not None for a in _attentions(model)]


EDITS = {  # the edits a served model receives, in the order one engine applies them
    "q_norm.weight.data = new": swap_qk_norm_data,
    "input_layernorm.weight.data = new": swap_layernorm_data,
    "post_attention_layernorm.weight.data = new": functools.partial(swap_layernorm_data,
                                                                    which="post_attention_layernorm", seed=4),
    "rotary_emb replaced by a module with another table": replace_rotary,
    "model._apply(clone), then in-place norm updates": apply_clone_then_update,
    "rotary_emb.cos_sin_cache.data = new": swap_table_data,
    "cos_sin_cache.data = a table shorter than max_model_len": functools.partial(swap_table_data, base=2e3, rows=64),
    "cos_sin_cache.data = a full table again": functools.partial(swap_table_data, base=3e3),
}
