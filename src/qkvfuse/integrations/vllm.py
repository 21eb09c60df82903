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
data-pointer/shape/dtype checks only, :mod:`qkvfuse.integrations._rebind`). A layer that stops qualifying after
such a change (say, a table now shorter than ``max_model_len``) runs vLLM's code from then on, with a log line.

A layer is fused only when it qualifies, else it keeps vLLM's code and the log says why: the methods qkvfuse
replaces and the vLLM code whose semantics it reproduces hash to a version it was tested with
(:data:`TESTED_SOURCES`, vLLM 0.32.0); the rotary module is ``RotaryEmbedding`` (or a subclass that changes only
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

import dataclasses
import hashlib
import importlib
import inspect
import logging
import os
import textwrap
import types
from typing import Dict, List, Optional, Tuple

import torch

from .. import ops
from .._checks import served_dtypes
from ..backends import resolve_backend
from ._engine_common import first_untested, when_imported
from ._rebind import Rebinding

__all__ = ["register", "fuse_model", "Options", "options_from_config", "TESTED_SOURCES", "CONFIG_KEY", "ENV_VAR"]

CONFIG_KEY = "qkvfuse"
ENV_VAR = "QKVFUSE_VLLM"
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
_NORM_SOURCES = ["RMSNorm.forward_native", "GemmaRMSNorm.forward_native"]
_OPTION_TYPES = {"attention": bool, "add_rmsnorm": bool, "verify": bool, "backend": str}


def source_hash(fn) -> str:
    """The hash :data:`TESTED_SOURCES` holds for a function: sha256 of its dedented source, 16 hex digits."""
    return hashlib.sha256(textwrap.dedent(inspect.getsource(fn)).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------------------
# Options.
# --------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Options:
    """What the plugin does for one engine (``additional_config["qkvfuse"]``)."""

    attention: bool = False
    add_rmsnorm: bool = False
    verify: bool = False
    backend: Optional[str] = None

    @property
    def enabled(self) -> bool:
        return self.attention or self.add_rmsnorm


def options_from_config(additional_config) -> Options:
    """Parse ``additional_config`` (vLLM's dict); ``$QKVFUSE_VLLM=1`` means ``{"attention": true}`` when it has
    no ``qkvfuse`` entry. Raises ``ValueError`` naming a bad key or value."""
    raw = additional_config.get(CONFIG_KEY) if isinstance(additional_config, dict) else None
    if raw is None:
        return Options(attention=True) if os.environ.get(ENV_VAR, "") == "1" else Options()
    if isinstance(raw, bool):
        return Options(attention=raw)
    if not isinstance(raw, dict):
        raise ValueError(f"additional_config[{CONFIG_KEY!r}]: expected a dict such as {{'attention': true}}, got "
                         f"{raw!r}")
    for key, value in raw.items():
        if key not in _OPTION_TYPES:
            raise ValueError(f"additional_config[{CONFIG_KEY!r}]: unknown key {key!r} (expected "
                             f"{', '.join(_OPTION_TYPES)})")
        if not isinstance(value, _OPTION_TYPES[key]) and not (key == "backend" and value is None):
            raise ValueError(f"additional_config[{CONFIG_KEY!r}][{key!r}]: expected a "
                             f"{_OPTION_TYPES[key].__name__}, got {value!r}")
    return Options(**raw)


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
    if message not in _logged:
        _logged.add(message)
        logger.info("%s", message)


# --------------------------------------------------------------------------------------------------------
# Version checks.
# --------------------------------------------------------------------------------------------------------
def _vllm_sources(module_name: str):
    """``{name in TESTED_SOURCES: function}`` for the model module ``module_name`` and the shared layers."""
    from vllm.model_executor.layers import layernorm
    from vllm.model_executor.layers.rotary_embedding import base, mrope

    models = importlib.import_module(f"vllm.model_executor.models.{module_name}")
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


def _untested(names: List[str], module_name: str) -> Optional[str]:
    """The first of ``names`` whose source hash is not a tested one (as a reason), else None."""
    return first_untested(names, _vllm_sources(module_name), TESTED_SOURCES, source_hash, "vLLM", "0.32.0")


# --------------------------------------------------------------------------------------------------------
# Attention layers.
# --------------------------------------------------------------------------------------------------------
class _Prepare:
    """One attention layer's fused prepare: the bound ops (eager) and the static arguments (compiled).

    Eager calls follow the running model. Before each call :meth:`ready` reads what vLLM's forward would read --
    the layer's current ``rotary_emb``, its ``cos_sin_cache`` (cast as vLLM's rotation casts it), the current
    ``q_norm`` / ``k_norm`` and their weights -- and compares them with what the bound ops were built from
    (identity, and for tensors data pointer, shape, strides, dtype and device: :class:`_rebind.Rebinding`; no
    tensor op). On a change the layer is checked again and re-bound, so no stale tensor, eps or recorded memory
    range is used; a layer that no longer qualifies (e.g. a table shorter than ``max_model_len``, a rotary class
    qkvfuse does not reproduce) runs vLLM's own forward until it qualifies again, with one log line.

    Gated attention (Qwen3-Next / Qwen3.5: the layer's ``attn_output_gate``): the projection output is
    ``[q_gate | k | v]``, Q and gate interleaved per head, and a call returns ``(q, k, v, gate)``. Gemma-style
    q/k norms (weights centred at 0, ``1 + w`` in fp32) follow the norm class the layer holds at each bind: the
    qualification rule admits only the engine's plain ``RMSNorm`` and ``GemmaRMSNorm``.
    """

    def __init__(self, module, backend: Optional[str], verify: bool, max_model_len: Optional[int] = None,
                 qualifies=None, engine: str = "vLLM"):
        """``qualifies(module)``: why the layer does not qualify, or None -- vLLM's rule (:func:`_layer_reason`)
        by default; another engine's plugin passes its own, and its name (``engine``) for the log lines."""
        self.module, self.backend, self.verify, self.engine = module, backend, verify, engine
        self.max_model_len = max_model_len
        self.qualifies = qualifies or (lambda m: _layer_reason(m, self.max_model_len, self.backend))
        self.qk_norm = getattr(module, "use_qk_norm", True)
        self.hq, self.hkv, self.head_dim = module.num_heads, module.num_kv_heads, module.head_dim
        self.q_gate = bool(getattr(module, "attn_output_gate", False))
        self.binding = Rebinding(self._bind)
        self.prep = self.prep_1d = None
        if not self.ready(None):
            raise ValueError(f"qkvfuse: {type(module).__name__} does not qualify: {self.reason}")

    def _items(self, like: Optional[torch.Tensor]) -> tuple:
        """What vLLM's forward reads at this call (the binding's items)."""
        m = self.module
        rot = _member(m, "_modules", "rotary_emb")
        table = _member(rot, "_buffers", "cos_sin_cache")
        if (like is not None and isinstance(table, torch.Tensor)
                and (table.dtype != like.dtype or table.device != like.device)
                and hasattr(rot, "_match_cos_sin_cache_dtype")):
            # vLLM's rotation casts the table to the activations' dtype and device first (and keeps the cast).
            table = rot._match_cos_sin_cache_dtype(like)
        if not self.qk_norm:
            return rot, table
        qn, kn = _member(m, "_modules", "q_norm"), _member(m, "_modules", "k_norm")
        return rot, table, qn, _member(qn, "_parameters", "weight"), kn, _member(kn, "_parameters", "weight")

    def ready(self, hidden_states: Optional[torch.Tensor]) -> bool:
        """Whether this call takes the fused path (re-binding first if anything it reads changed)."""
        if self.binding.get(*self._items(hidden_states)) is None:
            return False
        if hidden_states is not None and hidden_states.dtype not in self.io_dtypes:
            _log_once(f"qkvfuse: {type(self.module).__name__} runs {self.engine}'s code for {hidden_states.dtype} activations "
                      f"with q/k norm weights of another dtype")
            return False
        return True

    def _bind(self, rot, table, qn=None, q_weight=None, kn=None, k_weight=None):
        """(Re)build the bound ops from the rotary module, table and norms the layer holds now; None (and the
        reason, logged once) when the layer no longer qualifies."""
        reason = self.qualifies(self.module)
        if reason is None:
            try:
                prep = self._bound_ops(rot, table, qn, q_weight, k_weight)
            except (ValueError, TypeError) as exc:  # what qkvfuse's own validation refuses: vLLM's code then
                reason = f"qkvfuse refuses the layer's tensors: {exc}"
        self.reason = reason
        if reason is not None:
            if self.prep is not None:  # it was fused: say that this layer now runs vLLM's code
                _log_once(f"qkvfuse: {type(self.module).__name__} runs {self.engine}'s code after a change to the running "
                          f"model: {reason}")
            self.prep = self.prep_1d = None
            return None
        self.prep, self.prep_1d, self.sections, self.interleaved, self.eps, self.is_neox, self.gemma = prep
        c = self.prep.config
        self.io_dtypes = served_dtypes((c.q_weight, c.k_weight, c.q_bias, c.k_bias))
        return self.prep

    def _bound_ops(self, rot, table, qn, q_weight, k_weight) -> tuple:
        """The bound ops and their static arguments: ``(prep, prep_1d, sections, interleaved, eps, is_neox,
        gemma)``."""
        sections = tuple(rot.mrope_section) if getattr(rot, "mrope_section", None) else None
        interleaved = bool(getattr(rot, "mrope_interleaved", False))
        eps = qn.variance_epsilon if self.qk_norm else 1e-6
        is_neox = bool(rot.is_neox_style)
        gemma = self.qk_norm and type(qn).__name__ == "GemmaRMSNorm"
        qw, kw = (None, None) if q_weight is None else (q_weight.detach(), k_weight.detach())
        common = dict(q_weight=qw, k_weight=kw, eps=eps, is_neox=is_neox, q_gate=self.q_gate, gemma_norm=gemma,
                      backend=self.backend)
        prep = ops.QKNormRope(self.hq, self.hkv, self.head_dim, table, mrope_section=sections,
                              mrope_interleaved=interleaved, **common)
        # MRotaryEmbedding also takes 1-D (text-only) positions: equal rows, i.e. plain RoPE on the same table.
        prep_1d = ops.QKNormRope(self.hq, self.hkv, self.head_dim, table, **common) if sections else prep
        return prep, prep_1d, sections, interleaved, eps, is_neox, gemma

    def __call__(self, qkv: torch.Tensor, positions: torch.Tensor):
        """Q and K of ``qkv`` normed and rotated in place; ``(q, k, v)`` views (``(q, k, v, gate)`` for a gated
        layer, the row rewritten as ``[q | gate | k | v]``). Eager calls come after :meth:`ready` returned True
        for this call."""
        if torch.compiler.is_compiling():
            # The module's current parameters and table as graph inputs (dynamo reads them at trace time). In
            # place, as in eager mode: inductor re-inplaces the op on the projection output (used by nothing
            # else), so the graph allocates nothing for it; fresh outputs would cost fresh pages per call (the
            # functional op at T=512 ran 3-4x slower than in place inside vLLM's compiled graph).
            m = self.module
            qw, kw = (m.q_norm.weight, m.k_norm.weight) if self.qk_norm else (None, None)
            mrope = self.sections is not None and positions.dim() == 2
            return ops.split_qkv_rmsnorm_rope_(
                qkv, positions, m.rotary_emb._match_cos_sin_cache_dtype(qkv), self.hq, self.hkv, self.head_dim,
                q_weight=qw, k_weight=kw, eps=self.eps, is_neox=self.is_neox,
                mrope_section=self.sections if mrope else None, mrope_interleaved=self.interleaved,
                q_gate=self.q_gate, gemma_norm=self.gemma, backend=self.backend)
        prep = self.prep if positions.dim() == 2 or self.sections is None else self.prep_1d
        if self.verify:
            return _verified(self, prep, qkv, positions)
        return prep.inplace(qkv, positions)


def _member(obj, group: str, name: str):
    """``obj.<name>`` as ``nn.Module`` attribute lookup finds it, read from its ``_modules`` / ``_buffers`` /
    ``_parameters`` dict first (a dict read instead of ``Module.__getattr__``: this runs per layer per call)."""
    found = getattr(obj, group, None)
    found = found.get(name) if found is not None else None
    return found if found is not None else getattr(obj, name, None)


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


def _ungated(qkv: torch.Tensor, hq: int, head_dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``([q | k | v], gate)`` of a gated row ``[q_gate | k | v]`` (Q and gate interleaved per head), copies."""
    q_gate = qkv[:, : 2 * hq * head_dim].reshape(-1, hq, 2, head_dim)
    q, gate = q_gate[:, :, 0].reshape(-1, hq * head_dim), q_gate[:, :, 1].reshape(-1, hq * head_dim)
    return torch.cat([q, qkv[:, 2 * hq * head_dim :]], dim=-1), gate


def _vllm_prepare(module, qkv: torch.Tensor, positions: torch.Tensor, q_gate: bool = False):
    """vLLM's own prepare (the code the fused forward replaces), on a copy of ``qkv``; ``(q, k, v[, gate])``."""
    qkv, gate = _ungated(qkv, module.num_heads, module.head_dim) if q_gate else (qkv.clone(), None)
    q, k, v = qkv.split([module.q_size, module.kv_size, module.kv_size], dim=-1)
    if getattr(module, "use_qk_norm", True):
        q = module.q_norm(q.reshape(-1, module.num_heads, module.head_dim)).reshape(q.shape)
        k = module.k_norm(k.reshape(-1, module.num_kv_heads, module.head_dim)).reshape(k.shape)
    q, k = module.rotary_emb(positions, q, k)
    return (q, k, v) if gate is None else (q, k, v, gate)


def _verified(state: _Prepare, prep, qkv: torch.Tensor, positions: torch.Tensor):
    """The ``verify`` option: the fused result judged against a float64 oracle next to vLLM's own path."""
    from .._verify.accuracy import check_split_outputs  # the accuracy rule's one definition (verify mode only)
    from .._verify.oracle import oracle_split

    module = state.module
    unfused = _vllm_prepare(module, qkv, positions, state.q_gate)
    source, gate = _ungated(qkv, state.hq, state.head_dim) if state.q_gate else (qkv.clone(), None)
    outs = prep.inplace(qkv, positions)
    c = prep.config
    mrope = c.mrope
    # Gemma weights as the plain weights they stand for (1 + w, exact in float64): the oracle's plain rule.
    qw, kw = ((w.double() + 1 if state.gemma and w is not None else w) for w in (c.q_weight, c.k_weight))
    oracle = oracle_split(source, positions, c.cos_sin_cache, state.hq, state.hkv, state.head_dim,
                          q_weight=qw, k_weight=kw, eps=state.eps, is_neox=state.is_neox,
                          mrope_section=state.sections if mrope else None, mrope_interleaved=state.interleaved)
    report = check_split_outputs(outs[:3], oracle, unfused[:3], source, state.hq, state.hkv, state.head_dim)
    if gate is not None and not torch.equal(outs[3], gate):
        raise RuntimeError(f"qkvfuse verify: {type(module).__name__} fused gate is not a bit-exact copy")
    if not report.ok:
        raise RuntimeError(f"qkvfuse verify: {type(module).__name__} fused output fails the accuracy rule against "
                           f"vLLM's own path: {report}")
    return outs


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
    reason = _layer_reason(module, _max_model_len(vllm_config), backend)
    if reason is not None:
        return reason, ""
    rot = module.rotary_emb
    style = "neox" if rot.is_neox_style else "gptj"
    mrope = ""
    if getattr(rot, "mrope_section", None):
        mrope = f", mrope {list(rot.mrope_section)}{' interleaved' if rot.mrope_interleaved else ''}"
    name = resolve_backend(backend, rot.cos_sin_cache.device.type)
    return None, f"{name}, rotary {rot.rotary_dim}, {style}{mrope}"


def _max_model_len(vllm_config) -> Optional[int]:
    """The longest sequence the engine accepts (positions below it), or None when the config has no model."""
    model_config = getattr(vllm_config, "model_config", None)
    value = getattr(model_config, "max_model_len", None)
    return value if isinstance(value, int) else None


def _layer_reason(module, max_model_len: Optional[int], backend: Optional[str]) -> Optional[str]:
    """Why the layer's current rotary module, table and norms do not qualify, or None. Checked at load and
    whenever one of them changed in the running engine."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding

    rot = getattr(module, "rotary_emb", None)
    kind = type(rot)
    plain_table_change = isinstance(rot, RotaryEmbedding) and all(
        getattr(kind, name) is getattr(RotaryEmbedding, name)
        for name in ("forward", "forward_native", "forward_static", "forward_cpu", "forward_cuda", "forward_hip",
                     "forward_xpu", "_match_cos_sin_cache_dtype"))
    if not (plain_table_change or kind is MRotaryEmbedding) or "forward" in rot.__dict__:
        return f"rotary module {kind.__name__} is not one qkvfuse reproduces"
    cache = getattr(rot, "cos_sin_cache", None)
    head_dim, rotary_dim = module.head_dim, getattr(rot, "rotary_dim", None)
    if not isinstance(cache, torch.Tensor) or cache.dim() != 2 or cache.shape[1] != rotary_dim:
        return "the rotary module has no (max_position, rotary_dim) cos_sin_cache"
    if max_model_len is not None and cache.shape[0] < max_model_len:
        # vLLM's own rotation accepts every position below max_model_len (its CPU kernel does not bound-check
        # them); the fused op refuses positions past the table, which must never happen inside an engine.
        return (f"its rotary table has {cache.shape[0]} rows, fewer than max_model_len {max_model_len} (positions "
                f"past the table, e.g. a context extended past max_position_embeddings or a dynamic-NTK config)")
    if rot.head_size != head_dim:
        return f"rotary head_size {rot.head_size} != head_dim {head_dim}"
    if head_dim % 2 or head_dim > ops.MAX_HEAD_DIM or rotary_dim % 2 or rotary_dim > head_dim:
        return f"head_dim {head_dim} / rotary_dim {rotary_dim} outside qkvfuse's rules (even, <= 512)"
    if getattr(module, "use_qk_norm", True):
        norms = (getattr(module, "q_norm", None), getattr(module, "k_norm", None))
        if (type(norms[0]) is not type(norms[1]) or any(
                _plain_norm_reason(n) or "forward" in n.__dict__ or tuple(n.weight.shape) != (head_dim,)
                for n in norms)):
            return "q_norm/k_norm are not plain RMSNorm(head_dim) with a weight (or both GemmaRMSNorm(head_dim))"
        if norms[0].variance_epsilon != norms[1].variance_epsilon:
            return "q_norm and k_norm have different eps"
        if any(n.weight.device != cache.device for n in norms):
            return "q_norm/k_norm weights and the rotary table are on different devices"
    if cache.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"rotary table dtype {cache.dtype}"
    name = resolve_backend(backend, cache.device.type)
    if name == "reference" and backend != "reference":
        return f"no fast qkvfuse backend for {cache.device.type} tensors"
    return None


# --------------------------------------------------------------------------------------------------------
# Decoder-layer add + RMSNorm.
# --------------------------------------------------------------------------------------------------------
class _Norm:
    """One decoder-layer RMSNorm run by qkvfuse: in place with a residual (vLLM's fused kernel's form). A
    ``GemmaRMSNorm`` (the engine's class of that name: weight centred at 0, ``1 + w`` in fp32) runs as
    ``AddRMSNorm(..., gemma_norm=True)``."""

    def __init__(self, norm, backend: Optional[str], engine: str = "vLLM"):
        self.norm, self.backend, self.engine = norm, backend, engine
        self.eps = norm.variance_epsilon
        self.gemma = type(norm).__name__ == "GemmaRMSNorm"
        # Rebuilt when the weight is replaced or changes storage (`weight.data = ...`, `model._apply`), so the
        # bound op never reads freed memory or compares against stale byte ranges.
        self.binding = Rebinding(self._build)

    def _build(self, weight) -> Optional[ops.AddRMSNorm]:
        try:
            return ops.AddRMSNorm(weight.detach(), self.eps, gemma_norm=self.gemma, backend=self.backend)
        except (ValueError, TypeError, AttributeError) as exc:  # e.g. a weight swapped for another shape
            _log_once(f"qkvfuse: an RMSNorm runs {self.engine}'s code after a change to the running model: {exc}")
            return None

    @property
    def bound(self) -> Optional[ops.AddRMSNorm]:
        """The bound op for the norm's current weight (None: vLLM's code)."""
        return self.binding.get(_member(self.norm, "_parameters", "weight"))

    def __call__(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if torch.compiler.is_compiling():
            # In place with a residual, as vLLM's fused kernel and the eager path write (inductor re-inplaces it:
            # no fresh outputs per call); without one, x is the layer's residual from then on: a fresh output.
            if residual is None:
                return ops.add_rmsnorm(x, None, self.norm.weight, self.eps, gemma_norm=self.gemma,
                                       backend=self.backend)[0]
            return ops.add_rmsnorm_(x, residual, self.norm.weight, self.eps, gemma_norm=self.gemma,
                                    backend=self.backend)
        bound = self.binding.get(_member(self.norm, "_parameters", "weight"))
        if bound is None or x.dtype not in served_dtypes((bound.config.weight, bound.config.bias)):
            return type(self.norm).forward(self.norm, x, residual)
        if residual is None:
            return bound(x)[0]
        return bound.inplace(x, residual)


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
    reason = _plain_norm_reason(norm)
    if reason:
        return reason
    name = resolve_backend(backend, norm.weight.device.type)
    if name == "reference" and backend != "reference":
        return f"no fast qkvfuse backend for {norm.weight.device.type} tensors"
    return None


# --------------------------------------------------------------------------------------------------------
# The model walk.
# --------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Report:
    """What :func:`fuse_model` did: per class, how many layers were fused and why others were not."""

    fused: Dict[str, int] = dataclasses.field(default_factory=dict)
    total: Dict[str, int] = dataclasses.field(default_factory=dict)
    reasons: Dict[str, str] = dataclasses.field(default_factory=dict)
    details: Dict[str, str] = dataclasses.field(default_factory=dict)

    def lines(self) -> List[str]:
        out = []
        for name, total in self.total.items():
            fused = self.fused.get(name, 0)
            detail = f" ({self.details[name]})" if name in self.details else ""
            out.append(f"qkvfuse: fused {fused}/{total} {name}{detail}")
            if fused < total:
                out.append(f"qkvfuse: left {total - fused}/{total} {name} to vLLM: {self.reasons.get(name, '?')}")
        return out


def _module_of(cls) -> str:
    return cls.__module__.rsplit(".", 1)[-1]


def fuse_model(model: torch.nn.Module, vllm_config) -> Report:
    """Fuse the qualifying layers of a loaded vLLM ``model`` as ``vllm_config.additional_config`` asks (nothing
    when the plugin is off); returns the :class:`Report` it also logs once per process."""
    opts = options_from_config(getattr(vllm_config, "additional_config", None))
    report = Report()
    if not opts.enabled:
        return report
    untested: Dict[str, Optional[str]] = {}
    for module in model.modules():
        cls_name = type(module).__name__
        table = _ATTENTION if opts.attention and cls_name in _ATTENTION else (
            _DECODER if opts.add_rmsnorm and cls_name in _DECODER else None)
        if table is None or _module_of(type(module)) != table[cls_name]:
            continue
        if cls_name not in untested:
            names = [f"{cls_name}.{m}" for m in _METHODS.get(cls_name, ("forward",))] + (
                ["RotaryEmbedding.forward_static", "MRotaryEmbedding.forward_native", "apply_interleaved_rope"]
                if table is _ATTENTION else []) + _NORM_SOURCES
            untested[cls_name] = _untested(names, table[cls_name])
        if table is _ATTENTION:
            _fuse_attention(module, cls_name, vllm_config, opts, untested[cls_name], report)
        else:
            _fuse_norms(module, cls_name, vllm_config, opts, untested[cls_name], report)
    for line in report.lines():
        _log_once(line)
    return report


def _count(report: Report, name: str, reason: Optional[str], detail: str = "") -> None:
    report.total[name] = report.total.get(name, 0) + 1
    if reason is None:
        report.fused[name] = report.fused.get(name, 0) + 1
        if detail:
            report.details[name] = detail
    else:
        report.reasons.setdefault(name, reason)


def _fuse_attention(module, cls_name, vllm_config, opts: Options, untested: Optional[str], report: Report) -> None:
    reason, detail = (untested, "") if untested else _attention_reason(module, vllm_config, opts.backend)
    if reason is None:
        module._qkvfuse = _Prepare(module, opts.backend, opts.verify, _max_model_len(vllm_config))
        module.forward = types.MethodType(_fused_attention_forward, module)
    _count(report, cls_name, reason, detail)


def _fuse_norms(layer, cls_name, vllm_config, opts: Options, untested: Optional[str], report: Report) -> None:
    name = f"{cls_name} add+RMSNorm"
    for attr in ("input_layernorm", "post_attention_layernorm"):
        norm = getattr(layer, attr, None)
        reason = untested or (_norm_reason(norm, vllm_config, opts.backend) if norm is not None
                              else f"no {attr}")
        if reason is None:
            norm._qkvfuse = _Norm(norm, opts.backend)
            norm.forward = types.MethodType(_fused_norm_forward, norm)
        _count(report, name, reason, resolve_backend(opts.backend, norm.weight.device.type) if reason is None
               else "")
