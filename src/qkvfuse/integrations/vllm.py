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
``backend`` (``"auto"``, ``"cpu"``, ``"triton"``, ``"reference"``). Under vLLM's ``torch.compile`` the recommended
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
from typing import Dict, List, Optional, Tuple

import torch

from . import _engine_common as core
from ._engine_common import Options, first_untested, source_hash, when_imported

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
    return found


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
    (:func:`_layer_reason`; ``max_model_len``: the longest sequence the engine accepts)."""

    engine = ENGINE

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
    ``o_proj``, as ``Qwen3NextAttention.forward`` does."""
    state = self._qkvfuse
    if not torch.compiler.is_compiling() and not state.ready(hidden_states):
        return type(self).forward(self, positions, hidden_states)
    qkv, _ = self.qkv_proj(hidden_states)
    q, k, v, *gate = state(qkv, positions)
    attn_output = self.attn(q, k, v)
    if gate:
        attn_output = attn_output * torch.sigmoid(gate[0])
    output, _ = self.o_proj(attn_output)
    return output


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
        for cls_name, mod in _ATTENTION.items():
            targets[cls_name] = core.Target(
                f"{_MODELS}.{mod}", tuple(f"{cls_name}.{m}" for m in _METHODS.get(cls_name, ("forward",)))
                + tuple(_ROTARY_SOURCES + _NORM_SOURCES),
                lambda module, cls_name, untested, report: _fuse_attention(module, cls_name, vllm_config, opts,
                                                                           untested, report))
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


def _fuse_attention(module, cls_name, vllm_config, opts: Options, untested: Optional[str], report: Report) -> None:
    reason, detail = (untested, "") if untested else _attention_reason(module, vllm_config, opts.backend)
    if reason is None:
        module._qkvfuse = _Prepare(module, opts.backend, opts.verify, _max_model_len(vllm_config))
        core.install(module, "forward", _fused_attention_forward)
    report.count(cls_name, reason, detail)


def _fuse_norms(layer, cls_name, vllm_config, opts: Options, untested: Optional[str], report: Report) -> None:
    core.fuse_decoder_norms(layer, cls_name, untested, report, opts.backend,
                            lambda norm: _norm_reason(norm, vllm_config, opts.backend), _Norm, _fused_norm_forward)
