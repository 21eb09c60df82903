"""qkvfuse inside SGLang: fused attention-prepare (and optionally add+RMSNorm) for Qwen3 / Qwen3-MoE / GLM-4.x, and
the gated attention-prepare of Qwen3-Next / Qwen3.5.

Switched on per process environment, never by installing the package::

    QKVFUSE_SGLANG=1 python -m sglang.launch_server --model-path MODEL ...
    QKVFUSE_SGLANG='{"attention": true, "add_rmsnorm": true}' python -m sglang.launch_server ...

``1`` means ``{"attention": true}``; a JSON object takes the engine plugins' options (:class:`Options`):
``attention`` (bool) fuses each qualifying attention layer's split + QK-RMSNorm + RoPE/mRoPE into one
:class:`qkvfuse.QKNormRope` call; ``add_rmsnorm`` (bool) runs each decoder layer's two norms with
:class:`qkvfuse.AddRMSNorm` (in place, as SGLang's CUDA kernel writes); ``verify`` (bool, eager only) also runs
SGLang's own path on every fused call and raises past qkvfuse's accuracy rule; ``backend`` (``"auto"``,
``"cpu"``, ``"triton"``, ``"reference"``); ``kv_cache`` (bool, on unless set false; with ``attention``, eager,
not with ``verify``): the fused prepare also writes K and V into SGLang's KV pool and the layer's attention runs
with ``save_kv_cache=False`` (see below); and, SGLang only, ``shared_expert_overlap`` (bool): GLM-4.x MoE blocks
run their shared expert on a side stream beside the routed experts (:class:`qkvfuse.moe.SharedExpertOverlap`)
where SGLang does not already overlap them -- SGLang's own dual-stream path runs only inside CUDA-graph capture
on CUDA; the plugin's covers eager batches (extend/prefill, ``disable_cuda_graph``) and XPU/NPU, and is inline
(SGLang's bits) on CPU. Unset, empty or ``0``: the plugin changes nothing. A bad key or value stops the engine
with a ``ValueError`` naming it, whether or not any feature is on.

How it hooks in. :func:`register` is the ``sglang.srt.plugins`` entry point, which SGLang calls in every process
(engine, scheduler, detokenizer; ``SGLANG_PLUGINS`` whitelists by name, ``qkvfuse``). It only arranges for
``ModelRunner.load_model`` (and ``update_model_fields``, which installs a model reloaded from disk) to be wrapped
when SGLang imports the model runner -- only the scheduler processes do -- so it imports nothing of SGLang
itself. SGLang's ``HookRegistry`` would import its targets in every process at plugin-load time, hence the
import hook; the wrapper is the AROUND hook it would install. After a model is built and its weights loaded,
:func:`fuse_model` replaces, per qualifying layer *instance*, the one method that does the split + QK-norm +
RoPE -- ``Qwen3Attention.forward_prepare_native`` (also Qwen3-VL's text model), ``Qwen3MoeAttention.
apply_qk_norm_rope``, ``Glm4MoeAttention.forward_prepare`` (GLM-4.5/4.6/4.7, Air, GLM-4.5V's text model), and
``forward_prepare_native`` of the full-attention decoder layers of Qwen3-Next (``Qwen3HybridAttentionDecoderLayer``)
and Qwen3.5 / Qwen3.5-MoE (``Qwen3_5AttentionDecoderLayer``), gated (``q_gate``, Gemma q/k norms: ``gemma_norm``;
it returns ``(q, k, v, gate)``) -- with one that calls the layer's bound :class:`qkvfuse.QKNormRope` on the packed
projection output in place (Q and K rewritten inside it, V and the gate views: no copies). The classes and every
other layer keep SGLang's code (the decoder norms of Qwen3-Next / Qwen3.5 too: they run inside SGLang's stage
boundaries, which the ``add_rmsnorm`` option does not take over).

A layer is fused only when it qualifies, else it keeps SGLang's code and the log says why: the SGLang methods
replaced and the code whose semantics they reproduce hash to a tested version (:data:`TESTED_SOURCES`, SGLang
0.5.23; ``python -m qkvfuse.integrations.tested_sources`` prints the installed SGLang's hashes); the rotary module is ``RotaryEmbedding`` or a subclass that changes only its table (YaRN, linear, NTK,
Llama-3 scaling), or ``MRotaryEmbedding`` (sectioned or interleaved; not the GLM-interleaved layout), with a
table that covers the engine's context length (a shorter one SGLang may grow: left to SGLang); the QK-norms are
plain ``RMSNorm(head_dim)`` or both ``GemmaRMSNorm(head_dim)``; none of SGLang's own fused QK-norm+RoPE kernels
is active for the layer (aiter, sgl-kernel CPU/XPU/CUDA, NPU; Qwen3-Next's gfx950 aiter prologue; for Qwen3.5 its
CUDA ``fused_qk_gemma_rmsnorm_rope_gate`` and its HIP/XPU/CPU fused norm+gate kernels, so Qwen3.5 is fused where
SGLang's native prepare runs, e.g. its base platform on CPU); a fast qkvfuse backend runs on the device. One
log line per process says what it fused or why not, e.g. ``qkvfuse: fused 36/36 Qwen3Attention (cpu, rotary
128, neox)``.

A bound object follows the layer: it is rebuilt when SGLang replaces the rotary module, the table or a norm
weight, or gives one new storage (identity and ``data_ptr``; SGLang's weight updates and cache growth do both),
or when a setting the call uses changes value (a norm's ``variance_epsilon``, the rotary style, the mRoPE section
and interleaving). Every tensor a fused prepare returns has SGLang's shape and a layout SGLang's kernels read:
q, k and v are views of the projection output, as SGLang's own fused QK-norm kernels return them; the gate is
laid out as SGLang's own prepare returns it (Qwen3-Next: a contiguous ``[T, Hq*D]``, which its HIP
``fused_sigmoid_mul`` assumes; Qwen3.5: ``[T, Hq, D]``, read by its strides).

The KV-cache write (``kv_cache``). A fused layer's ``RadixAttention`` and the class method that holds the forward
batch without passing it to the prepare (``Qwen3Attention.forward``, the gated layers' ``self_attention``) are
wrapped on the instance. At each eager call the fused prepare reads the active attention backend and its pool
(SGLang's forward context) and, where they are ones qkvfuse writes as SGLang would -- the ``torch_native`` or
``intel_amx`` backend; an ``MHATokenToKVPool`` (or the full-attention pool of a ``HybridLinearKVPool``) in the NHD
layout, unquantized, storing the activations' dtype or FP8 (``intel_amx``: the activations' dtype only) --
writes K and V at ``out_cache_loc`` (the layer's ``k_buffer`` / ``v_buffer`` ``[slots, kv_heads, head_dim]``,
qkvfuse's NHD with block size 1; padded rows as SGLang's attention: the real ones only) in the same fused call.
The attention then gets ``save_kv_cache=False`` for that K (K and V None in ``intel_amx``'s decode, whose kernel
writes what it is given). Same-dtype pools hold the bits SGLang's writer stores from the same K/V; FP8 pools the
fp32 result rounded once to nearest even and saturated (SGLang casts the activations: a near tie may round the
other way; an e5m2 overflow SGLang stores as inf). Anything else -- another backend or pool kind, an untested
version of that SGLang code (:data:`_KV_SOURCES`), compiled code -- keeps SGLang's own write, with one log line per
class and reason, e.g. ``qkvfuse: fused the KV-cache write of Qwen3Attention (MHATokenToKVPool torch.bfloat16,
TorchNativeAttnBackend)``.

Numerics: the rotary table is SGLang's own (in the dtype SGLang keeps it); qkvfuse computes norm and rotation in
fp32 and rounds once -- at least as accurate as SGLang's unfused path. Tensor parallelism works as it does for
SGLang's code: each rank's layer holds its local heads.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import sys
import weakref
from typing import Callable, ClassVar, Dict, List, Optional, Tuple

import torch

from ..moe.overlap import SharedExpertOverlap, process_runner
from . import _engine_common as core
from ._engine_common import first_untested, source_hash, when_imported

__all__ = ["register", "fuse_model", "Options", "options_from_env", "TESTED_SOURCES", "ENV_VAR", "Report",
           "source_hash"]

ENV_VAR = "QKVFUSE_SGLANG"
ENGINE, TESTED_VERSION = "SGLang", "0.5.23"
logger = logging.getLogger("sglang.qkvfuse")  # SGLang's processes log the root logger at its --log-level

# --------------------------------------------------------------------------------------------------------
# The SGLang code the fused methods replace or reproduce, by a hash of its source (SGLang 0.5.23). A layer whose
# class's code hashes differently is left to SGLang, with one log line naming the method.
# --------------------------------------------------------------------------------------------------------
TESTED_SOURCES: Dict[str, Tuple[str, ...]] = {
    "Qwen3Attention.forward": ("fd628d8233c8a976",),
    "Qwen3Attention.forward_prepare_native": ("4df2581ff2a1d888",),
    "Qwen3MoeAttention.forward_prepare_native": ("2454de22c5596807",),
    "Qwen3MoeAttention.apply_qk_norm_rope": ("3ac39c5e8adba86f",),
    "Qwen3MoeAttention.forward_core": ("f84f28f92b44941c",),
    "Glm4MoeAttention.forward_prepare": ("1eabd2f32a866c83",),
    "Glm4MoeAttention.forward_core": ("f5d4ffe861e237e1",),
    "apply_qk_norm": ("d896736d964d464b",),
    "RotaryEmbedding.forward_native": ("509da88fdf26f814",),
    "MRotaryEmbedding.forward_native": ("80e95956af4d9164",),
    "apply_interleaved_rope": ("88f2f5d8b1178ae2",),
    "apply_rotary_emb": ("14486971b6c3ee73",),
    "RMSNorm.forward_native": ("89513f603ab2f21b",),
    "GemmaRMSNorm.forward_native": ("a539f9c0a57533e7",),
    "Qwen3HybridAttentionDecoderLayer.forward_prepare_native": ("3effcbeb6bfe46fc",),
    "Qwen3HybridAttentionDecoderLayer.self_attention": ("4f362224209930a5",),
    "Qwen3HybridAttentionDecoderLayer._apply_qk_norm": ("fb32d37affbdcf8b",),
    "Qwen3_5AttentionDecoderLayer.forward_prepare_native": ("55fa4b77b789b2b7",),
    "Qwen3_5AttentionDecoderLayer._prepare_qkv_gate": ("506dd61bd80f364f",),
    "Qwen3_5AttentionDecoderLayer.self_attention": ("89ad4bc1f835aecd",),
    "Qwen3_5AttentionDecoderLayer._apply_qk_norm": ("aa79ba01ec93e4ec",),
    "Qwen3DecoderLayer.forward": ("462c8d36df49e44d",),
    "Qwen3MoeDecoderLayer.forward": ("64642d12c4a91782",),
    "Glm4MoeDecoderLayer.forward": ("e0047aa72f35ff23",),
    "Glm4MoeSparseMoeBlock.forward": ("61be01c462666be8",),
    "Glm4MoeSparseMoeBlock.forward_normal": ("44c39506df4381a3",),
    "Glm4MoeSparseMoeBlock._forward_shared_experts": ("e55e13c705dcd64f",),
    # the KV-cache write (kv_cache): the attention entry, the backends whose write is skipped, the pools written
    "RadixAttention.forward": ("55e4295da33d1f0f",),
    "AttentionBackend.forward": ("64367e6c255ad849",),
    "padded_extend_real_tokens": ("94fe1a9b9b47a845",),
    "TorchNativeAttnBackend.forward_extend": ("95338bf74c3324d6",),
    "TorchNativeAttnBackend.forward_decode": ("a2c6dd583cdc9c3f",),
    "IntelAMXAttnBackend.forward_extend": ("d99450ac1c578f84",),
    "IntelAMXAttnBackend.forward_decode": ("ad1163ad3ccf3451",),
    "MHATokenToKVPool.set_kv_buffer": ("f0e58db1c519a026",),
    "MHATokenToKVPool._store_kv_layer": ("d3f3939d6ff7cbcd",),
    "MHATokenToKVPool._get_key_buffer": ("3bcaf1ab4a4b2ccc",),
    "_set_kv_buffer_impl": ("742df9d85a8f9a1d",),
    "HybridLinearKVPool.set_kv_buffer": ("02e2399e09edb5f1",),
    "HybridLinearKVPool._transfer_full_attention_id": ("a92ca06b37084638",),
}

# class -> (model module, the method the plugin replaces on the instance). Qwen3-Next and Qwen3.5 fold their
# gated full attention into the decoder layer: the layer holds qkv_proj, q_norm/k_norm (GemmaRMSNorm) and
# rotary_emb, and its forward_prepare_native returns (q, k, v, gate).
_ATTENTION = {"Qwen3Attention": ("qwen3", "forward_prepare_native"),
              "Qwen3MoeAttention": ("qwen3_moe", "apply_qk_norm_rope"),
              "Glm4MoeAttention": ("glm4_moe", "forward_prepare"),
              "Qwen3HybridAttentionDecoderLayer": ("qwen3_next", "forward_prepare_native"),
              "Qwen3_5AttentionDecoderLayer": ("qwen3_5", "forward_prepare_native")}
_ATTENTION_SOURCES = {"Qwen3Attention": ("forward", "forward_prepare_native"),
                      "Qwen3MoeAttention": ("forward_prepare_native", "apply_qk_norm_rope", "forward_core"),
                      "Glm4MoeAttention": ("forward_prepare", "forward_core"),
                      "Qwen3HybridAttentionDecoderLayer": ("forward_prepare_native", "self_attention",
                                                           "_apply_qk_norm"),
                      "Qwen3_5AttentionDecoderLayer": ("forward_prepare_native", "_prepare_qkv_gate",
                                                       "self_attention", "_apply_qk_norm")}
_SHARED_ATTENTION_SOURCES = ("apply_qk_norm", "RotaryEmbedding.forward_native", "MRotaryEmbedding.forward_native",
                             "apply_interleaved_rope", "apply_rotary_emb", "RMSNorm.forward_native",
                             "GemmaRMSNorm.forward_native")
_DECODER = {"Qwen3DecoderLayer": "qwen3", "Qwen3MoeDecoderLayer": "qwen3_moe", "Glm4MoeDecoderLayer": "glm4_moe"}
# class -> (model module, the methods whose code the overlapped forward_normal reproduces or relies on)
_MOE = {"Glm4MoeSparseMoeBlock": ("glm4_moe", ("forward", "forward_normal", "_forward_shared_experts"))}
_MODELS = "sglang.srt.models"
# RotaryEmbedding methods a subclass may not override to count as "changes only its table"
_ROTARY_METHODS = ("forward", "forward_native", "forward_cpu", "forward_cuda", "forward_npu", "forward_xpu",
                   "forward_hip", "forward_musa", "_match_cos_sin_cache_dtype")


# --------------------------------------------------------------------------------------------------------
# Options.
# --------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Options(core.Options):
    """The engine plugins' options (:class:`._engine_common.Options`), plus ``shared_expert_overlap`` (GLM-4.x
    MoE blocks; see the module docstring)."""

    shared_expert_overlap: bool = False

    TYPES: ClassVar[Dict[str, type]] = dict(core.Options.TYPES, shared_expert_overlap=bool)

    @property
    def enabled(self) -> bool:
        """Whether the plugin changes anything."""
        return self.attention or self.add_rmsnorm or self.shared_expert_overlap


def options_from_env(value: Optional[str] = None) -> Options:
    """Parse ``$QKVFUSE_SGLANG`` (or ``value``): unset / empty / ``0`` off, ``1`` attention only, or a JSON object
    with the keys of :class:`Options`. Raises ``ValueError`` naming a bad key or value
    (:func:`._engine_common.parse_options`, whatever the features asked for)."""
    raw = (os.environ.get(ENV_VAR, "") if value is None else value).strip()
    if raw in ("", "0"):
        return Options()
    if raw == "1":
        return Options(attention=True)
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = raw
    if isinstance(parsed, bool):
        return Options(attention=parsed)
    if not isinstance(parsed, dict):
        raise ValueError(f"${ENV_VAR}: expected 1 or a JSON object such as {{\"attention\": true}}, got {raw!r}")
    return core.parse_options(Options, parsed, f"${ENV_VAR}")


# --------------------------------------------------------------------------------------------------------
# The entry point.
# --------------------------------------------------------------------------------------------------------
_MARK = "__qkvfuse_wrapped__"
_RUNNER_MODULE = "sglang.srt.model_executor.model_runner"


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: arrange for each model SGLang's ``ModelRunner`` loads to pass
    through :func:`fuse_model`. Idempotent and cheap: it imports nothing of SGLang (the runner module is wrapped
    when SGLang imports it, or now if it already has)."""
    when_imported(_RUNNER_MODULE, _wrap_runner)


def _wrap_runner(module) -> None:
    runner = module.ModelRunner
    load_model, update_model_fields = runner.load_model, runner.update_model_fields
    if getattr(load_model, _MARK, False):
        return

    def around_load_model(self, *args, **kwargs):
        result = load_model(self, *args, **kwargs)
        fuse_model(self.model, context_len=_context_len(self))
        return result

    def around_update_model_fields(self, new_model, *args, **kwargs):
        fuse_model(new_model, context_len=_context_len(self))
        return update_model_fields(self, new_model, *args, **kwargs)

    for name, original, wrapper in (("load_model", load_model, around_load_model),
                                    ("update_model_fields", update_model_fields, around_update_model_fields)):
        wrapper.__wrapped__ = original
        wrapper.__name__ = wrapper.__qualname__ = name
        setattr(wrapper, _MARK, True)
        setattr(runner, name, wrapper)


def _context_len(runner) -> Optional[int]:
    config = getattr(runner, "model_config", None)
    return getattr(config, "context_len", None)


_logged: set = set()


def _log_once(message: str) -> None:
    core.log_once(logger, _logged, message)


# --------------------------------------------------------------------------------------------------------
# Version checks.
# --------------------------------------------------------------------------------------------------------
def _sglang_sources(module_name: str) -> Dict[str, Callable]:
    """``{name in TESTED_SOURCES: function}`` for the model module ``module_name`` and the shared layers."""
    from sglang.srt.layers import layernorm
    from sglang.srt.layers.rotary_embedding import base, mrope, utils
    from sglang.srt.models import utils as model_utils

    models = importlib.import_module(f"{_MODELS}.{module_name}")
    found = {"apply_qk_norm": model_utils.apply_qk_norm,
             "RotaryEmbedding.forward_native": base.RotaryEmbedding.forward_native,
             "MRotaryEmbedding.forward_native": mrope.MRotaryEmbedding.forward_native,
             "apply_interleaved_rope": mrope.apply_interleaved_rope,
             "apply_rotary_emb": utils.apply_rotary_emb,
             "RMSNorm.forward_native": layernorm.RMSNorm.forward_native,
             "GemmaRMSNorm.forward_native": layernorm.GemmaRMSNorm.forward_native}
    found.update(_kv_sources())
    for cls_name, (mod, _) in _ATTENTION.items():
        if mod == module_name and hasattr(models, cls_name):
            for method in _ATTENTION_SOURCES[cls_name]:
                found[f"{cls_name}.{method}"] = getattr(getattr(models, cls_name), method)
    for cls_name, mod in _DECODER.items():
        if mod == module_name and hasattr(models, cls_name):
            found[f"{cls_name}.forward"] = getattr(models, cls_name).forward
    for cls_name, (mod, methods) in _MOE.items():
        if mod == module_name and hasattr(models, cls_name):
            for method in methods:
                found[f"{cls_name}.{method}"] = getattr(getattr(models, cls_name), method)
    return found


def model_modules() -> List[str]:
    """The SGLang model modules whose classes the plugin fuses (``tested_sources`` reads them all)."""
    return sorted({mod for mod, _ in _ATTENTION.values()} | set(_DECODER.values()) | {m for m, _ in _MOE.values()})


def _untested(names: List[str], module_name: str) -> Optional[str]:
    """The first of ``names`` whose source hash is not a tested one (as a reason), else None."""
    module_name = module_name.rsplit(".", 1)[-1]
    return first_untested(names, _sglang_sources(module_name), TESTED_SOURCES, source_hash, ENGINE, TESTED_VERSION)


# --------------------------------------------------------------------------------------------------------
# Attention layers.
# --------------------------------------------------------------------------------------------------------
class _Prepare(core.BoundPrepare):
    """The core's bound prepare (:class:`._engine_common.BoundPrepare`) under SGLang's qualification rule
    (:func:`_attention_reason`; ``context_len``: the engine's maximum context)."""

    engine = ENGINE

    def __init__(self, module, backend: Optional[str], verify: bool, context_len: Optional[int] = None):
        self.context_len = context_len
        super().__init__(module, backend, verify)

    def qualifies(self, module) -> Optional[str]:
        return _attention_reason(module, self.context_len, self.backend)[0]

    def inplace_cache(self, qkv: torch.Tensor, positions: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slots: torch.Tensor, k_scale: Optional[torch.Tensor],
                      v_scale: Optional[torch.Tensor]):
        """The eager call (after :meth:`ready`) that also writes K and V into ``key_cache`` / ``value_cache``
        (``[slots, 1, kv_heads, head_dim]``: NHD, block size 1) at ``slots``; the views of ``__call__``."""
        prep = self.prep if positions.dim() == 2 or self.sections is None else self.prep_1d
        return prep.inplace_cache(qkv, positions, key_cache, value_cache, slots, layout="NHD", k_scale=k_scale,
                                  v_scale=v_scale)

    def log(self, message: str) -> None:
        _log_once(message)


def _prepare(module, qkv: torch.Tensor, positions: torch.Tensor, forward_batch=None):
    """``(q, k, v)`` of ``qkv`` [T, (Hq + 2 Hkv) * D], Q and K normed and rotated in place (a gated layer:
    ``(q, k, v, gate)`` of ``[q_gate | k | v]``); None when the layer no longer qualifies (the bound prepare
    re-binds first when SGLang replaced or re-stored what it reads, and says so once when the result does not
    qualify) or, gated, for an empty batch (SGLang's code splits it). With the ``kv_cache`` option, eager, and
    ``forward_batch`` (the call's batch; None: not known here) whose pool qualifies, the same fused call also
    writes K and V into SGLang's KV pool (:class:`_KVWrite`)."""
    state = module._qkvfuse
    compiling = torch.compiler.is_compiling()
    if not compiling and not state.ready(qkv):
        return None
    if qkv.shape[0] == 0:  # nothing to normalise; SGLang's split of an empty batch
        return None if state.q_gate else qkv.split([module.q_size, module.kv_size, module.kv_size], dim=-1)
    kv = module.__dict__.get("_qkvfuse_kv")
    if kv is not None and not compiling and not state.verify:
        batch = forward_batch if forward_batch is not None else kv.batch
        if batch is not None:
            out = kv.write(state, qkv, positions, batch)
            if out is not None:
                return out
    return state(qkv, positions)


def _bind(module, backend: Optional[str], verify: bool, context_len: Optional[int]) -> _Prepare:
    state = module._qkvfuse = _Prepare(module, backend, verify, context_len)
    return state


# --------------------------------------------------------------------------------------------------------
# The KV-cache write (the kv_cache option).
# --------------------------------------------------------------------------------------------------------
# SGLang's attention backends whose own K/V write the plugin takes over: class name -> (its module under
# sglang.srt.layers.attention, whether its decode writes the K/V it is given even with save_kv_cache=False, whether
# an FP8 pool is written for it). torch_native writes only through set_kv_buffer, which save_kv_cache=False
# skips, and reads K/V from the pool. intel_amx's decode kernel writes the K/V it is given (it gets None, as
# SGLang's own FP8 decode passes them) and its extend reads the new tokens' K/V from its arguments (kept); its
# FP8 pools are left to SGLang (its kernels' own FP8 conversions are not reproduced here).
_KV_BACKENDS = {"TorchNativeAttnBackend": ("torch_native_backend", False, True),
                "IntelAMXAttnBackend": ("intel_amx_backend", True, False)}
_KV_SOURCES = ("RadixAttention.forward", "AttentionBackend.forward", "padded_extend_real_tokens",
               "TorchNativeAttnBackend.forward_extend", "TorchNativeAttnBackend.forward_decode",
               "IntelAMXAttnBackend.forward_extend", "IntelAMXAttnBackend.forward_decode",
               "MHATokenToKVPool.set_kv_buffer", "MHATokenToKVPool._store_kv_layer",
               "MHATokenToKVPool._get_key_buffer", "_set_kv_buffer_impl", "HybridLinearKVPool.set_kv_buffer",
               "HybridLinearKVPool._transfer_full_attention_id")
# class -> the method of the class that holds the forward batch and calls the prepare without it (wrapped on the
# instance so the prepare sees the batch); Qwen3-MoE's and GLM's prepares take the batch themselves.
_BATCH_CALLERS = {"Qwen3Attention": "forward", "Qwen3HybridAttentionDecoderLayer": "self_attention",
                  "Qwen3_5AttentionDecoderLayer": "self_attention"}
_FP8_POOLS = (torch.float8_e4m3fn, torch.float8_e5m2)


def _kv_sources() -> Dict[str, Callable]:
    """``{name in TESTED_SOURCES: function}`` for the SGLang code the KV-cache write relies on."""
    from sglang.srt.layers import radix_attention
    from sglang.srt.layers.attention import base_attn_backend, graph_utils
    from sglang.srt.mem_cache import memory_pool

    found = {"RadixAttention.forward": radix_attention.RadixAttention.forward,
             "AttentionBackend.forward": base_attn_backend.AttentionBackend.forward,
             "padded_extend_real_tokens": graph_utils.padded_extend_real_tokens,
             "_set_kv_buffer_impl": memory_pool._set_kv_buffer_impl}
    for cls_name, methods in (("MHATokenToKVPool", ("set_kv_buffer", "_store_kv_layer", "_get_key_buffer")),
                              ("HybridLinearKVPool", ("set_kv_buffer", "_transfer_full_attention_id"))):
        for method in methods:
            found[f"{cls_name}.{method}"] = getattr(getattr(memory_pool, cls_name), method)
    for cls_name, (mod, _, _) in _KV_BACKENDS.items():
        cls = getattr(importlib.import_module(f"sglang.srt.layers.attention.{mod}"), cls_name)
        for method in ("forward_extend", "forward_decode"):
            found[f"{cls_name}.{method}"] = getattr(cls, method)
    return found


def _kv_untested() -> Optional[str]:
    """Why the KV-cache write is left to SGLang in this SGLang (its code differs from the tested), or None."""
    try:
        sources = _kv_sources()
    except (ImportError, AttributeError) as exc:
        return f"SGLang's KV-cache code not found ({type(exc).__name__}: {exc})"
    return first_untested(_KV_SOURCES, sources, TESTED_SOURCES, source_hash, ENGINE, TESTED_VERSION)


@dataclasses.dataclass(frozen=True)
class _KVPlan:
    """How one layer writes one pool: ``hybrid`` (a ``HybridLinearKVPool``: its full-attention sub-pool, the layer
    id translated), ``fp8`` (the pool's FP8 dtype, stored as uint8; None: the activations' dtype), the unit
    scales SGLang's writer applies (it divides by none), and whether K/V go to the attention as None in decode."""

    hybrid: bool
    fp8: Optional[torch.dtype]
    scales: Optional[Tuple[torch.Tensor, torch.Tensor]]
    drop_kv_in_decode: bool
    real_tokens: Callable
    description: str


class _KVWrite:
    """One fused layer's KV-cache write: the fused prepare writes K and V into SGLang's pool at the batch's
    ``out_cache_loc`` (the layer's pool buffers ``[slots, kv_heads, head_dim]``, qkvfuse's ``NHD`` with block size
    1), then the layer's ``RadixAttention`` runs with ``save_kv_cache=False`` (and K/V None where the backend's
    decode writes them anyway) -- for the K tensor the prepare returned and that batch only; any other call
    keeps SGLang's own write.

    Per call it reads the active attention backend and pool (SGLang's forward context) and, for each new
    (backend, pool, dtype), decides once whether they are ones qkvfuse writes as SGLang would (one log line per
    class and decision): a tested backend (:data:`_KV_BACKENDS`), an ``MHATokenToKVPool`` (or a
    ``HybridLinearKVPool`` over one) in the NHD layout, unquantized (no quant method), of the layer's head
    count and head_dim, storing the activations' dtype or FP8 (``float8_e4m3fn`` / ``float8_e5m2`` as uint8:
    rounded once from fp32 to nearest even and saturated, where SGLang's writer casts the activations with
    ``.to()``)."""

    def __init__(self, module):
        self.module, self.name, self.attn = module, type(module).__name__, module.attn
        self.batch = None  # the forward batch of the call in progress, set by the caller's wrapper
        self.written = None  # (k, forward_batch, drop k/v) of the last fused write, for the attention call
        self._seen: Optional[tuple] = None  # weak (backend, pool) and dtype the plan was made for
        self._plan = None

    def plan(self, qkv: torch.Tensor) -> Optional[_KVPlan]:
        """The plan for the active backend and pool and ``qkv``'s dtype, or None (SGLang writes)."""
        from sglang.srt.model_executor.forward_context import get_attn_backend, has_forward_context

        if not has_forward_context():
            return None
        backend = get_attn_backend()
        pool = getattr(backend, "token_to_kv_pool", None)
        seen = self._seen
        if seen is None or seen[0]() is not backend or seen[1]() is not pool or seen[2] != qkv.dtype:
            plan = self._decide(backend, pool, qkv)
            if isinstance(plan, str):
                _log_once(f"qkvfuse: left the KV-cache write of {self.name} to {ENGINE}: {plan}")
            else:
                _log_once(f"qkvfuse: fused the KV-cache write of {self.name} ({plan.description})")
            self._seen, self._plan = (weakref.ref(backend), weakref.ref(pool), qkv.dtype), plan
        return None if isinstance(self._plan, str) else self._plan

    def _decide(self, backend, pool, qkv: torch.Tensor):
        """A :class:`_KVPlan`, or the reason (a string) the write stays SGLang's."""
        from sglang.srt.layers.attention.graph_utils import padded_extend_real_tokens
        from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MHATokenToKVPool

        kind = type(backend)
        entry = _KV_BACKENDS.get(kind.__name__)
        if entry is None or kind.__module__ != f"sglang.srt.layers.attention.{entry[0]}":
            return f"attention backend {kind.__name__} is not one whose write qkvfuse takes over"
        if getattr(backend, "use_mla", False) or getattr(backend, "swa_out_cache_loc", None) is not None:
            return "an MLA or sliding-window attention backend"
        layer, m = self.attn, self.module
        if layer.is_cross_attention or layer.qk_head_dim != m.head_dim or layer.v_head_dim != m.head_dim:
            return "a cross-attention layer, or K/V head sizes other than the layer's head_dim"
        hybrid = type(pool) is HybridLinearKVPool
        target = pool.full_kv_pool if hybrid and not pool.use_mla else pool
        if type(target) is not MHATokenToKVPool:
            return f"KV pool {type(pool).__name__} is not one qkvfuse writes (MHATokenToKVPool, or a " \
                   "HybridLinearKVPool over one)"
        if target.kv_cache_layout != "nhd" or target.use_hnd or target.is_quantized_kv_cache:
            return f"the KV pool's layout {target.kv_cache_layout!r} or quantization method is not one qkvfuse writes"
        if target.requires_physical_write_loc:
            return "a unified KV pool (translated write locations)"
        if (target.head_num, target.head_dim, target.v_head_dim) != (m.num_kv_heads, m.head_dim, m.head_dim):
            return (f"KV pool heads {target.head_num} x {target.head_dim} != the layer's {m.num_kv_heads} x "
                    f"{m.head_dim}")
        fp8 = None
        if target.dtype in _FP8_POOLS and target.store_dtype == torch.uint8:
            if not entry[2]:
                return f"an FP8 KV pool on {kind.__name__} (its kernels' own FP8 conversion)"
            fp8 = target.dtype
        elif target.dtype != qkv.dtype or target.store_dtype != target.dtype:
            return f"KV pool dtype {target.dtype} for {qkv.dtype} activations"
        scales = None
        if fp8 is not None:
            one = torch.ones((), dtype=torch.float32, device=qkv.device)
            scales = (one, one)
        where = "HybridLinearKVPool's full-attention " if hybrid else ""
        return _KVPlan(hybrid, fp8, scales, entry[1], padded_extend_real_tokens,
                       f"{where}MHATokenToKVPool {target.dtype}, {kind.__name__}")

    def write(self, state, qkv: torch.Tensor, positions: torch.Tensor, forward_batch):
        """The fused prepare with the KV-cache write, the views it returns; None when this call leaves the write
        to SGLang (nothing written)."""
        mode = getattr(forward_batch, "forward_mode", None)
        if mode is None or mode.is_idle():
            return None
        plan = self.plan(qkv)
        if plan is None:
            return None
        backend_pool = self._seen[1]()
        layer_id = self.attn.layer_id
        if plan.hybrid:
            layer_id = backend_pool._transfer_full_attention_id(layer_id)
            backend_pool = backend_pool.full_kv_pool
        index = layer_id - backend_pool.start_layer
        key_cache, value_cache = backend_pool.k_buffer[index], backend_pool.v_buffer[index]
        if plan.fp8 is not None:
            key_cache, value_cache = key_cache.view(plan.fp8), value_cache.view(plan.fp8)
        slots = forward_batch.out_cache_loc
        real = plan.real_tokens(qkv, forward_batch)  # padded rows: SGLang's attention writes the real ones only
        if real is not None:
            slots = slots[:real]
        k_scale, v_scale = plan.scales if plan.scales is not None else (None, None)
        out = state.inplace_cache(qkv, positions, key_cache.unsqueeze(1), value_cache.unsqueeze(1), slots, k_scale,
                                  v_scale)
        self.written = (out[1], forward_batch, plan.drop_kv_in_decode and mode.is_decode())
        return out


def _attention_after_write(self, q, k, v, forward_batch, save_kv_cache: bool = True, **kwargs):
    """``RadixAttention.forward`` of a layer whose fused prepare writes the KV cache: called with the K the prepare
    returned for this batch, SGLang's own write is skipped (``save_kv_cache=False``; K/V None where the
    backend's decode would write them anyway); any other call is SGLang's unchanged."""
    kv = self._qkvfuse_kv
    written, kv.written = kv.written, None
    if written is not None and k is written[0] and forward_batch is written[1]:
        save_kv_cache = False
        if written[2]:
            k = v = None
    return type(self).forward(self, q, k, v, forward_batch, save_kv_cache=save_kv_cache, **kwargs)


def _forward_with_batch(self, positions: torch.Tensor, hidden_states, forward_batch, *args, **kwargs):
    """The class's method that holds the forward batch (:data:`_BATCH_CALLERS`), with the batch lent to the
    fused prepare it calls."""
    kv = self._qkvfuse_kv
    kv.batch = forward_batch
    try:
        return getattr(type(self), _BATCH_CALLERS[kv.name])(self, positions, hidden_states, forward_batch, *args,
                                                             **kwargs)
    finally:
        kv.batch = None


def _install_kv_write(module) -> Optional[str]:
    """Give a fused layer the KV-cache write (:class:`_KVWrite`); the reason when it has no attention to hand it
    to."""
    attn = getattr(module, "attn", None)
    if type(attn).__name__ != "RadixAttention" or not isinstance(getattr(attn, "layer_id", None), int):
        return "the layer has no RadixAttention"
    kv = _KVWrite(module)
    module._qkvfuse_kv = attn._qkvfuse_kv = kv
    core.install(attn, "forward", _attention_after_write)
    if kv.name in _BATCH_CALLERS:
        core.install(module, _BATCH_CALLERS[kv.name], _forward_with_batch)
    return None


def _fused_qwen3_prepare(self, positions: torch.Tensor, hidden_states: torch.Tensor):
    """``Qwen3Attention.forward_prepare_native`` with the split + QK-norm + RoPE in one fused call."""
    qkv, _ = self.qkv_proj(hidden_states)
    out = _prepare(self, qkv, positions)
    if out is None:
        return type(self).forward_prepare_native(self, positions, hidden_states)
    return out


def _fused_qwen3_moe_qk_norm_rope(self, qkv: torch.Tensor, positions: torch.Tensor, forward_batch):
    """``Qwen3MoeAttention.apply_qk_norm_rope`` fused; K/V then go to the cache through ``forward_core``'s
    ``save_kv_cache`` (the flag SGLang's own fused kernels set), never through the rotary module."""
    out = _prepare(self, qkv, positions, forward_batch)
    if out is None:
        return type(self).apply_qk_norm_rope(self, qkv, positions, forward_batch)
    self._used_fused_qk_norm_rope_last_call = True
    return out


def _fused_glm4_moe_prepare(self, positions: torch.Tensor, hidden_states, forward_batch):
    """``Glm4MoeAttention.forward_prepare`` (its non-NPU branch) with the split + QK-norm + RoPE fused."""
    hs = hidden_states[0] if isinstance(hidden_states, tuple) else hidden_states
    if hs.shape[0] == 0:
        return hidden_states, forward_batch, None
    qkv, _ = self.qkv_proj(hidden_states)
    out = _prepare(self, qkv, positions, forward_batch)
    if out is None:  # recompute the projection: SGLang's method starts from hidden_states
        return type(self).forward_prepare(self, positions, hidden_states, forward_batch)
    q, k, v = out
    return None, forward_batch, (q, k, v, forward_batch)


def _fused_qwen3_next_prepare(self, positions: torch.Tensor, hidden_states: torch.Tensor):
    """``forward_prepare_native`` of Qwen3-Next's / Qwen3.5's full-attention decoder layer, fused: ``(q, k, v,
    gate)`` (gate None when the layer has no output gate), the gate laid out as SGLang's own prepare returns it:
    Qwen3.5's ``[T, Hq, D]`` (its ``fused_sigmoid_mul`` reads a 3-D gate by its strides: a view), Qwen3-Next's a
    contiguous ``[T, Hq * D]`` (on HIP its ``fused_sigmoid_mul`` reads a 2-D gate with row stride ``Hq * D``: the
    fused op's gate, a column view of the projection output, would be misread)."""
    if isinstance(hidden_states, tuple):  # a fused all-reduce + quant input: SGLang's code picks the operand
        return type(self).forward_prepare_native(self, positions, hidden_states)
    qkv, _ = self.qkv_proj(hidden_states)
    out = _prepare(self, qkv, positions)
    if out is None:
        return type(self).forward_prepare_native(self, positions, hidden_states)
    if len(out) == 3:
        return (*out, None)
    q, k, v, gate = out
    if type(self).__name__ == "Qwen3_5AttentionDecoderLayer":
        gate = gate.unflatten(1, (self.num_heads, self.head_dim))
    else:
        gate = gate.contiguous()
    return q, k, v, gate


_FUSED = {"Qwen3Attention": _fused_qwen3_prepare, "Qwen3MoeAttention": _fused_qwen3_moe_qk_norm_rope,
          "Glm4MoeAttention": _fused_glm4_moe_prepare, "Qwen3HybridAttentionDecoderLayer": _fused_qwen3_next_prepare,
          "Qwen3_5AttentionDecoderLayer": _fused_qwen3_next_prepare}


def _competing_fusion(module) -> Optional[str]:
    """One of SGLang's own fused QK-norm(+RoPE) kernels that this layer would run, if any."""
    models = importlib.import_module(type(module).__module__)
    if getattr(models, "_is_npu", False):
        return "SGLang's NPU split_qkv_rmsnorm_rope path is active"
    if getattr(models, "_use_fused_prologue", False) and getattr(module, "attn_output_gate", False):
        return "SGLang's aiter fused attention prologue (gfx950) is active"
    if type(module).__name__ == "Qwen3_5AttentionDecoderLayer":
        for flag, kernel in (("_is_cuda", "fused_qk_gemma_rmsnorm_rope_gate"),
                             ("_is_hip", "fused_qk_gemma_rmsnorm(_with_gate)"),
                             ("_is_xpu", "fused_qk_gemma_rmsnorm(_with_gate)"),
                             ("_is_cpu", "fused_qk_gemma_rmsnorm(_with_gate) (sgl-kernel CPU)")):
            if getattr(models, flag, False):
                return f"SGLang's own {kernel} kernel runs for this layer ({flag})"
    for flag in ("use_fused_qk_norm_rope", "use_fused_qk_norm_mrope", "use_fused_qk_norm_rope_cpu"):
        if getattr(module, flag, False):
            return f"SGLang's own fused QK-norm+RoPE kernel is on for this layer ({flag})"
    return None


_SHORT_TABLE = "rotary table of {rows} positions < context length {need} (SGLang grows it on demand)"


def _attention_reason(module, context_len: Optional[int], backend: Optional[str]) -> Tuple[Optional[str], str]:
    """``(None, description)`` when ``module`` qualifies, else ``(reason, "")``: SGLang's competing fusions and
    rotary rule, then the core's attention checks."""
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding
    from sglang.srt.layers.rotary_embedding.mrope import MRotaryEmbedding

    competing = _competing_fusion(module)
    if competing:
        return competing, ""
    rot = getattr(module, "rotary_emb", None)
    kind = type(rot)
    base = MRotaryEmbedding if isinstance(rot, MRotaryEmbedding) else RotaryEmbedding
    if not isinstance(rot, RotaryEmbedding) or any(getattr(kind, name, None) is not getattr(base, name, None)
                                                   for name in _ROTARY_METHODS):
        return f"rotary module {kind.__name__} is not one qkvfuse reproduces", ""
    if base is MRotaryEmbedding and getattr(rot, "mrope_interleaved_glm", False):
        return "the GLM-interleaved mRoPE layout (mrope_interleaved_glm) is not one qkvfuse reproduces", ""
    if getattr(rot, "position_start", 0) != 0 or hasattr(rot, "sin_cos_cache"):
        return "the rotary module reads its table at an offset or from a precomputed sin_cos_cache", ""
    return core.attention_reason(module, rot, backend, _plain_norm, context_len, _SHORT_TABLE)


def _plain_norm(norm, size: int) -> Optional[str]:
    """None when ``norm`` is SGLang's plain ``RMSNorm(size)`` (:func:`_plain_rmsnorm`) or its ``GemmaRMSNorm(size)``
    (weight centred at 0, ``1 + w`` in fp32: ``gemma_norm``), else a reason."""
    from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm

    if type(norm) is not GemmaRMSNorm:
        return _plain_rmsnorm(norm, RMSNorm, size)
    if "forward" in norm.__dict__ or not isinstance(getattr(norm, "weight", None), torch.Tensor):
        return "the GemmaRMSNorm has no weight or its forward is replaced"
    if tuple(norm.weight.shape) != (size,):
        return f"GemmaRMSNorm weight shape {tuple(norm.weight.shape)} != ({size},)"
    return None


def _plain_rmsnorm(norm, rmsnorm_cls, size: int) -> Optional[str]:
    """None when ``norm`` is SGLang's ``RMSNorm(size)`` computing what qkvfuse computes, else a reason."""
    if type(norm) is not rmsnorm_cls or not norm.has_weight or norm.variance_size_override is not None:
        return f"{type(norm).__name__} is not a plain RMSNorm with a weight"
    if norm.cast_x_before_out_mul or norm.fp32_residual or norm.override_orig_dtype is not None:
        return "the RMSNorm uses SGLang's deterministic-inference dtype options"
    if norm.__dict__.get("_quant_linear") is not None:
        return "the RMSNorm fuses its consumer's FP8 input quantization"
    if tuple(norm.weight.shape) != (size,):
        return f"RMSNorm weight shape {tuple(norm.weight.shape)} != ({size},)"
    return None


# --------------------------------------------------------------------------------------------------------
# Decoder-layer add + RMSNorm.
# --------------------------------------------------------------------------------------------------------
class _Norm(core.BoundNorm):
    """The core's bound decoder norm (:class:`._engine_common.BoundNorm`) in SGLang's name and log."""

    engine = ENGINE

    def log(self, message: str) -> None:
        _log_once(message)


def _fused_norm_forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
                        post_residual_addition: Optional[torch.Tensor] = None, quant_linear=None):
    """SGLang's ``RMSNorm.forward(x, residual)`` by qkvfuse; the forms qkvfuse does not take keep SGLang's code."""
    if (post_residual_addition is not None or quant_linear is not None or x.dim() != 2 or x.shape[0] == 0
            or (residual is not None and residual.shape != x.shape)):
        return type(self).forward(self, x, residual, post_residual_addition, quant_linear)
    return self._qkvfuse(x, residual)  # re-binds itself when the weight or eps changed


def _norm_reason(norm, backend: Optional[str]) -> Optional[str]:
    from sglang.srt.layers.layernorm import RMSNorm

    return (_plain_rmsnorm(norm, RMSNorm, getattr(norm, "hidden_size", -1))
            or core.fast_backend_reason(backend, norm.weight.device.type))


# --------------------------------------------------------------------------------------------------------
# GLM-4.x MoE: the shared expert on a side stream.
# --------------------------------------------------------------------------------------------------------
def _overlapped_forward_normal(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``Glm4MoeSparseMoeBlock.forward_normal`` with the shared expert on a side stream: the same calls in the same
    order (shared expert, router + top-k + routed experts and their scaling, the sum into a fresh tensor), the
    shared expert forked onto the side stream and joined before the sum (:class:`qkvfuse.moe.SharedExpertOverlap`'s
    protocol). SGLang's own method runs where there is no stream to use (CPU) or nothing to overlap. Neither path
    issues a collective (the shared expert is built with ``reduce_results=False``; the all-reduce follows the
    block), so the two streams never both talk to the process group."""
    runner = self._qkvfuse_overlap
    if hidden_states.shape[0] == 0 or runner.stream_module(hidden_states.device) is None:
        return type(self).forward_normal(self, hidden_states)
    models = sys.modules[type(self).__module__]  # SGLang's module flags and helpers, as its method reads them

    def routed(hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.topk(hidden, self.gate(hidden)))
        if not models._is_cuda and not models._use_aiter:
            out *= self.routed_scaling_factor
        return out

    def combine(routed_out: torch.Tensor, shared_out: torch.Tensor) -> torch.Tensor:
        with models.use_symmetric_memory(models.get_parallel().tp_group,
                                         disabled=not models.is_allocation_symmetric()):
            out = torch.empty_like(routed_out)
        return torch.add(routed_out, shared_out, out=out)

    return runner.run(hidden_states, self._forward_shared_experts, routed, combine)


def _moe_reason(block) -> Optional[str]:
    if getattr(block, "num_fused_shared_experts", 0) or getattr(block, "shared_experts", None) is None:
        return "no separate shared expert (fused into the routed experts, or none)"
    if getattr(block, "_enable_a2a_moe", False):
        return "all-to-all MoE (DeepEP/A2A) overlaps on its own path"
    return None


def fuse_moe(block, report: Optional[Report] = None, untested: Optional[str] = None,
             runner: Optional[SharedExpertOverlap] = None) -> "Report":
    """Give one ``Glm4MoeSparseMoeBlock`` the overlapped ``forward_normal`` if it qualifies (``runner``: the overlap
    helper, default one per process). Returns ``report`` (a new one if None)."""
    report = Report() if report is None else report
    reason = untested or _moe_reason(block)
    if reason is None:
        block._qkvfuse_overlap = runner if runner is not None else process_runner()
        core.install(block, "forward_normal", _overlapped_forward_normal)
    report.count(f"{type(block).__name__} shared-expert overlap", reason,
                 "side stream on cuda/xpu/npu, inline on cpu" if reason is None else "")
    return report


# --------------------------------------------------------------------------------------------------------
# The model walk.
# --------------------------------------------------------------------------------------------------------
class Report(core.Report):
    """What :func:`fuse_model` did: per class, how many layers were fused and why others were not."""

    engine = ENGINE


def fuse_model(model: torch.nn.Module, options: Optional[Options] = None,
               context_len: Optional[int] = None) -> Report:
    """Fuse the qualifying layers of a loaded SGLang ``model`` as ``options`` (default: ``$QKVFUSE_SGLANG``)
    asks -- nothing when off; ``context_len`` is the engine's maximum context (a shorter rotary table is left
    to SGLang). Returns the :class:`Report` it also logs once per process."""
    opts = options_from_env() if options is None else options
    report = Report()
    if not opts.enabled:
        return report
    targets = {}
    if opts.attention:
        kv_untested = _kv_untested() if opts.kv_cache and not opts.verify else None
        for cls_name, (mod, _) in _ATTENTION.items():
            targets[cls_name] = core.Target(
                f"{_MODELS}.{mod}", tuple(f"{cls_name}.{m}" for m in _ATTENTION_SOURCES[cls_name])
                + _SHARED_ATTENTION_SOURCES,
                lambda module, cls_name, untested, report: fuse_attention(module, opts, context_len, report,
                                                                          untested, kv_untested))
    if opts.add_rmsnorm:
        for cls_name, mod in _DECODER.items():
            targets[cls_name] = core.Target(f"{_MODELS}.{mod}", (f"{cls_name}.forward", "RMSNorm.forward_native"),
                                            lambda module, cls_name, untested, report: _fuse_norms(
                                                module, cls_name, opts, untested, report))
    if opts.shared_expert_overlap:
        for cls_name, (mod, methods) in _MOE.items():
            targets[cls_name] = core.Target(f"{_MODELS}.{mod}", tuple(f"{cls_name}.{m}" for m in methods),
                                            lambda module, cls_name, untested, report: fuse_moe(
                                                module, report, untested))
    core.walk(model, targets, _untested, report)
    for line in report.lines():
        _log_once(line)
    return report


_NO_KV = object()


def fuse_attention(module, opts: Options, context_len: Optional[int] = None, report: Optional[Report] = None,
                   untested: Optional[str] = None, kv_untested=_NO_KV) -> Report:
    """Fuse one attention layer (a class of the attention table) if it qualifies: its prepare method is replaced
    on the instance, and with ``opts.kv_cache`` (eager, not ``verify``) the layer writes SGLang's KV cache from
    the fused op where the pool qualifies (:class:`_KVWrite`; ``kv_untested``: the tested-source guard's reason
    for that code, computed here when not given). Returns ``report`` (a new one if None)."""
    report = Report() if report is None else report
    cls_name = type(module).__name__
    reason, detail = (untested, "") if untested else _attention_reason(module, context_len, opts.backend)
    if reason is None:
        _bind(module, opts.backend, opts.verify, context_len)
        core.install(module, _ATTENTION[cls_name][1], _FUSED[cls_name])
        if opts.kv_cache and not opts.verify:
            kv_reason = (_kv_untested() if kv_untested is _NO_KV else kv_untested) or _install_kv_write(module)
            if kv_reason is not None:
                _log_once(f"qkvfuse: left the KV-cache write of {cls_name} to {ENGINE}: {kv_reason}")
    report.count(cls_name, reason, detail)
    return report


def _fuse_norms(layer, cls_name, opts: Options, untested: Optional[str], report: Report) -> None:
    core.fuse_decoder_norms(layer, cls_name, untested, report, opts.backend,
                            lambda norm: _norm_reason(norm, opts.backend), _Norm, _fused_norm_forward)
