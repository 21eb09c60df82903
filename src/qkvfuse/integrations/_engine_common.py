"""The engine-neutral core of the engine plugins (:mod:`.vllm`, :mod:`.sglang`).

An engine plugin is its hook points, its class tables, its competing-fusion checks and its replacement methods;
everything else lives here, once:

* :func:`when_imported` -- runs a callback on a module right after Python executes it (or now, if it already has),
  so an entry point that every engine process loads can patch one engine module without importing it where the
  engine does not (vLLM's front end never imports its model loader, SGLang's never imports its model runner);
* :class:`Options` and :func:`parse_options` -- the plugin options and their one validation rule;
* :func:`source_hash`, :func:`first_untested`, :func:`current_sources` -- the tested-source guard (and what
  ``python -m qkvfuse.integrations.tested_sources`` prints);
* :class:`Report` and :func:`log_once` -- what a model walk did, and its one log line per fact;
* :class:`Target` and :func:`walk` -- the model walk over an engine's class tables;
* :func:`attention_reason`, :func:`fast_backend_reason` -- the qualification checks every engine makes;
* :class:`BoundPrepare` and :class:`BoundNorm` -- one layer's fused attention prepare and one decoder norm, bound
  once and re-bound (:mod:`._rebind`) whenever what the engine's own forward reads at that call changed: the
  modules, their tensors' storage, and the scalars (eps, rotary style, mRoPE section and interleaving) by value.

An engine subclasses :class:`BoundPrepare` / :class:`BoundNorm` with its name, its log and its qualification
rule. Nothing here imports an engine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.abc
import inspect
import sys
import textwrap
import types
from typing import Callable, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .. import ops
from .._checks import served_dtypes
from ..backends import BACKEND_NAMES, resolve_backend
from ._rebind import Rebinding

__all__ = ["when_imported", "pending_imports", "source_hash", "first_untested", "current_sources", "Options", "parse_options",
           "Report", "log_once", "Target", "walk", "attention_reason", "fast_backend_reason", "BoundPrepare",
           "BoundNorm", "member", "ungated", "engine_prepare", "fuse_decoder_norms", "install"]

# --------------------------------------------------------------------------------------------------------
# Patching an engine module when the engine imports it.
# --------------------------------------------------------------------------------------------------------
_callbacks: Dict[str, List[Callable]] = {}


def when_imported(module_name: str, callback: Callable) -> None:
    """Call ``callback(module)`` once ``module_name`` has been executed: now if it is in ``sys.modules``, else
    right after its import (one finder in ``sys.meta_path`` for all pending modules; it steps out when none is
    left). The same callback registered twice for one module runs once."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return
    pending = _callbacks.setdefault(module_name, [])
    if callback not in pending:
        pending.append(callback)
    if not any(isinstance(f, _ImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportHook())


class _ImportHook(importlib.abc.MetaPathFinder):
    """Wraps the loader of each pending module so that its callbacks run right after it executes."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module
                callbacks = _callbacks.pop(fullname)

                def exec_and_call(module, exec_module=exec_module, callbacks=callbacks):
                    exec_module(module)
                    for callback in callbacks:
                        callback(module)

                spec.loader.exec_module = exec_and_call
                if not _callbacks and self in sys.meta_path:
                    sys.meta_path.remove(self)
                return spec
        return None


def pending_imports() -> List[str]:
    """The module names :func:`when_imported` still waits for (tests)."""
    return sorted(_callbacks)


# --------------------------------------------------------------------------------------------------------
# The tested-source guard.
# --------------------------------------------------------------------------------------------------------
def source_hash(fn) -> str:
    """The hash an engine's ``TESTED_SOURCES`` holds for a function: sha256 of its dedented source, 16 hex
    digits (``inspect.getsource`` reads through ``__wrapped__``)."""
    return hashlib.sha256(textwrap.dedent(inspect.getsource(fn)).encode()).hexdigest()[:16]


def first_untested(names: Sequence[str], sources: Mapping[str, Callable], tested: Mapping[str, Sequence[str]],
                   hash_of: Callable[[Callable], str], engine: str, version: str) -> Optional[str]:
    """The reason a plugin leaves a layer to the engine when one of ``names`` (looked up in ``sources``: the
    engine's functions now) is missing or hashes (``hash_of``) to none of its ``tested`` versions; None when all
    are tested."""
    for name in names:
        fn = sources.get(name)
        if fn is None:
            return f"{name} not found in this {engine}"
        if hash_of(fn) not in tested[name]:
            return (f"{name} differs from the {engine} versions qkvfuse was tested with ({version}); its code is left "
                    "in place")
    return None


def current_sources(sources_of: Callable[[str], Mapping[str, Callable]], modules: Sequence[str]
                    ) -> Tuple[Dict[str, Callable], Dict[str, str]]:
    """Every guarded function an engine holds now, ``{name: function}`` (``sources_of(module)`` per model module),
    and the model modules that could not be read, ``{module: error}`` (``tested_sources``)."""
    found: Dict[str, Callable] = {}
    failed: Dict[str, str] = {}
    for module in modules:
        try:
            found.update(sources_of(module))
        except Exception as exc:  # noqa: BLE001 -- an engine module that does not import here is reported, not fatal
            failed[module] = f"{type(exc).__name__}: {exc}"
    return found, failed


# --------------------------------------------------------------------------------------------------------
# Options.
# --------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Options:
    """What a plugin does for one engine: ``attention`` fuses each qualifying attention layer's prepare,
    ``add_rmsnorm`` each decoder layer's two norms, ``verify`` (eager only) also runs the engine's own prepare on
    every fused call and raises past qkvfuse's accuracy rule, ``backend`` picks qkvfuse's backend (None or
    ``"auto"``: the device's fast one), ``kv_cache`` (with ``attention``; on unless set false) lets a fused layer
    write the engine's KV cache from the fused op where the engine's cache qualifies, the engine's attention then
    skipping its own write. An engine adds its own options by subclassing (and extending :attr:`TYPES`)."""

    attention: bool = False
    add_rmsnorm: bool = False
    verify: bool = False
    backend: Optional[str] = None
    kv_cache: bool = True

    TYPES: ClassVar[Dict[str, type]] = {"attention": bool, "add_rmsnorm": bool, "verify": bool, "backend": str,
                                        "kv_cache": bool}

    @property
    def enabled(self) -> bool:
        """Whether the plugin changes anything."""
        return self.attention or self.add_rmsnorm


def parse_options(cls, raw: dict, where: str):
    """``cls(**raw)`` once every key of ``raw`` is one of ``cls.TYPES``, each value of its type, and ``backend``
    None, ``"auto"`` or a qkvfuse backend -- whether or not any feature is on, so a misspelt setting never passes
    silently. Raises ``ValueError`` naming ``where`` (the setting, e.g. ``$QKVFUSE_SGLANG``), the key and the
    value."""
    types_ = cls.TYPES
    for key, value in raw.items():
        if key not in types_:
            raise ValueError(f"{where}: unknown key {key!r} (expected {', '.join(types_)})")
        if not isinstance(value, types_[key]) and not (key == "backend" and value is None):
            raise ValueError(f"{where}[{key!r}]: expected a {types_[key].__name__}, got {value!r}")
    backend = raw.get("backend")
    if backend is not None and backend != "auto" and backend not in BACKEND_NAMES:
        raise ValueError(f"{where}['backend']: expected one of {('auto',) + BACKEND_NAMES} or null, got "
                         f"{backend!r}")
    return cls(**raw)


# --------------------------------------------------------------------------------------------------------
# The report and its log lines.
# --------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Report:
    """What a plugin's ``fuse_model`` did: per class, how many layers were fused and why others were not. An
    engine's subclass names the engine (:attr:`engine`) in the "left to" lines."""

    fused: Dict[str, int] = dataclasses.field(default_factory=dict)
    total: Dict[str, int] = dataclasses.field(default_factory=dict)
    reasons: Dict[str, str] = dataclasses.field(default_factory=dict)
    details: Dict[str, str] = dataclasses.field(default_factory=dict)

    engine: ClassVar[str] = "the engine"

    def count(self, name: str, reason: Optional[str], detail: str = "") -> None:
        """One layer of class ``name``: fused (``reason`` None; ``detail`` describes how) or left, and why (the
        first reason per class is kept)."""
        self.total[name] = self.total.get(name, 0) + 1
        if reason is None:
            self.fused[name] = self.fused.get(name, 0) + 1
            if detail:
                self.details[name] = detail
        else:
            self.reasons.setdefault(name, reason)

    def lines(self) -> List[str]:
        """The log lines: one per class, and one more per class with layers left to the engine."""
        out = []
        for name, total in self.total.items():
            fused = self.fused.get(name, 0)
            detail = f" ({self.details[name]})" if name in self.details else ""
            out.append(f"qkvfuse: fused {fused}/{total} {name}{detail}")
            if fused < total:
                out.append(f"qkvfuse: left {total - fused}/{total} {name} to {self.engine}: "
                           f"{self.reasons.get(name, '?')}")
        return out


def log_once(logger, logged: set, message: str) -> None:
    """``logger.info(message)`` the first time ``message`` is seen in ``logged`` (one line per fact per process:
    a fact repeats once per layer and per model load)."""
    if message not in logged:
        logged.add(message)
        logger.info("%s", message)


# --------------------------------------------------------------------------------------------------------
# The model walk.
# --------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Target:
    """A class the plugin fuses: the engine's model module that defines it (an instance of a class of that name
    from elsewhere, or of a subclass, is not touched), the names of its ``TESTED_SOURCES`` the fused code replaces
    or reproduces, and ``fuse(module, cls_name, untested, report)``, which fuses one instance or counts why not
    (``untested``: the tested-source guard's reason, or None)."""

    module: str
    sources: Tuple[str, ...]
    fuse: Callable


def walk(model: torch.nn.Module, targets: Mapping[str, Target],
         untested: Callable[[List[str], str], Optional[str]], report: Report) -> Report:
    """Pass each submodule of ``model`` whose class is one of ``targets`` (by name and defining module) to its
    ``fuse``; the tested-source guard (``untested(names, module)``) runs once per class."""
    seen: Dict[str, Optional[str]] = {}
    for module in model.modules():
        cls = type(module)
        target = targets.get(cls.__name__)
        if target is None or cls.__module__ != target.module:
            continue
        if cls.__name__ not in seen:
            seen[cls.__name__] = untested(list(target.sources), target.module)
        target.fuse(module, cls.__name__, seen[cls.__name__], report)
    return report


# --------------------------------------------------------------------------------------------------------
# The qualification checks every engine makes.
# --------------------------------------------------------------------------------------------------------
def fast_backend_reason(backend: Optional[str], device_type: str) -> Optional[str]:
    """Why qkvfuse should not run ``device_type`` tensors for the plugin: the reference backend is what would run
    (and was not asked for by name). None when a fast backend serves them."""
    if resolve_backend(backend, device_type) == "reference" and backend != "reference":
        return f"no fast qkvfuse backend for {device_type} tensors"
    return None


def attention_reason(module, rot, backend: Optional[str], plain_norm: Callable[[object, int], Optional[str]],
                     min_rows: Optional[int], short_table: str) -> Tuple[Optional[str], str]:
    """``(None, description)`` when an attention layer whose rotary module ``rot`` the engine's rule already
    admits qualifies, else ``(reason, "")``: a ``(max_position, rotary_dim)`` table of at least ``min_rows`` rows
    (else ``short_table.format(rows=..., need=...)``: the engine's words for why), head_dim and rotary_dim within
    qkvfuse's rules, q/k norms the engine's plain RMSNorm or both Gemma ones (``plain_norm(norm, head_dim)``: a
    reason or None) with one eps on the table's device, a table dtype qkvfuse reads, a fast backend."""
    cache = getattr(rot, "cos_sin_cache", None)
    head_dim, rotary_dim = module.head_dim, getattr(rot, "rotary_dim", None)
    if not isinstance(cache, torch.Tensor) or cache.dim() != 2 or cache.shape[1] != rotary_dim:
        return "the rotary module has no (max_position, rotary_dim) cos_sin_cache", ""
    if min_rows is not None and cache.shape[0] < min_rows:
        return short_table.format(rows=cache.shape[0], need=min_rows), ""
    if rot.head_size != head_dim:
        return f"rotary head_size {rot.head_size} != head_dim {head_dim}", ""
    if head_dim % 2 or head_dim > ops.MAX_HEAD_DIM or rotary_dim % 2 or rotary_dim > head_dim:
        return f"head_dim {head_dim} / rotary_dim {rotary_dim} outside qkvfuse's rules (even, <= 512)", ""
    if getattr(module, "use_qk_norm", True):
        norms = (getattr(module, "q_norm", None), getattr(module, "k_norm", None))
        if type(norms[0]) is not type(norms[1]) or any(plain_norm(n, head_dim) is not None for n in norms):
            return "q_norm/k_norm are not plain RMSNorm(head_dim) with a weight (or both GemmaRMSNorm(head_dim))", ""
        if norms[0].variance_epsilon != norms[1].variance_epsilon:
            return "q_norm and k_norm have different eps", ""
        if any(n.weight.device != cache.device for n in norms):
            return "q_norm/k_norm weights and the rotary table are on different devices", ""
    if cache.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"rotary table dtype {cache.dtype}", ""
    reason = fast_backend_reason(backend, cache.device.type)
    if reason is not None:
        return reason, ""
    style = "neox" if rot.is_neox_style else "gptj"
    sections = getattr(rot, "mrope_section", None)
    mrope = f", mrope {list(sections)}{' interleaved' if rot.mrope_interleaved else ''}" if sections else ""
    return None, f"{resolve_backend(backend, cache.device.type)}, rotary {rotary_dim}, {style}{mrope}"


# --------------------------------------------------------------------------------------------------------
# One attention layer's fused prepare.
# --------------------------------------------------------------------------------------------------------
def member(obj, group: str, name: str):
    """``obj.<name>`` as ``nn.Module`` attribute lookup finds it, read from its ``_modules`` / ``_buffers`` /
    ``_parameters`` dict first (a dict read instead of ``Module.__getattr__``: this runs per layer per call)."""
    found = getattr(obj, group, None)
    found = found.get(name) if found is not None else None
    return found if found is not None else getattr(obj, name, None)


def _setting(obj, name: str, default=None):
    """A plain attribute of a module (its instance dict, else its class), without ``Module.__getattr__``'s miss
    path: the scalars the bound call uses are read on every call."""
    found = obj.__dict__.get(name, _MISSING)
    return getattr(type(obj), name, default) if found is _MISSING else found


_MISSING = object()


class BoundPrepare:
    """One attention layer's fused prepare: the bound ops (eager) and the layer's settings (compiled).

    Eager calls follow the running model. Before each call :meth:`ready` reads what the engine's forward would
    read -- the layer's current ``rotary_emb``, its ``cos_sin_cache`` (cast as the engine's rotation casts it),
    its rotary style and mRoPE section and interleaving, the current ``q_norm`` / ``k_norm``, their weights and
    their eps -- and compares them with what the bound ops were built from (identity; for tensors data pointer,
    shape, strides, dtype and device; the scalars by value: :class:`._rebind.Rebinding`; no tensor op). On a
    change the layer is checked again and re-bound, so no stale tensor, eps or recorded memory range is used; a
    layer that no longer qualifies runs the engine's own code until it qualifies again, with one log line.

    Gated attention (Qwen3-Next / Qwen3.5: the layer's ``attn_output_gate``): the projection output is
    ``[q_gate | k | v]``, Q and gate interleaved per head, and a call returns ``(q, k, v, gate)``. Gemma-style
    q/k norms (weights centred at 0, ``1 + w`` in fp32) follow the norm class the layer holds at each bind: the
    engine's qualification rule admits only its plain ``RMSNorm`` and ``GemmaRMSNorm``.

    An engine subclasses it with :attr:`engine` (its name in log lines), :meth:`qualifies` (its rule) and
    :meth:`log` (its log).
    """

    engine = "the engine"

    def __init__(self, module, backend: Optional[str], verify: bool):
        self.module, self.backend, self.verify = module, backend, verify
        self.qk_norm = getattr(module, "use_qk_norm", True)
        self.hq, self.hkv, self.head_dim = module.num_heads, module.num_kv_heads, module.head_dim
        self.q_gate = bool(getattr(module, "attn_output_gate", False))
        self.binding = Rebinding(self._bind)
        self.prep = self.prep_1d = None
        self.reason: Optional[str] = None
        if not self.ready(None):
            raise ValueError(f"qkvfuse: {type(module).__name__} does not qualify: {self.reason}")

    def qualifies(self, module) -> Optional[str]:
        """Why the layer's current rotary module, table and norms do not qualify (the engine's rule), or None."""
        raise NotImplementedError

    def log(self, message: str) -> None:
        """One log line through the engine's log (once per process)."""
        raise NotImplementedError

    def _items(self, like: Optional[torch.Tensor]) -> tuple:
        """What the engine's forward reads at this call (the binding's items)."""
        m = self.module
        rot = member(m, "_modules", "rotary_emb")
        table = member(rot, "_buffers", "cos_sin_cache")
        if (like is not None and isinstance(table, torch.Tensor)
                and (table.dtype != like.dtype or table.device != like.device)
                and hasattr(rot, "_match_cos_sin_cache_dtype")):
            # The engine's rotation casts the table to the activations' dtype and device first (and keeps it).
            table = rot._match_cos_sin_cache_dtype(like)
        rotation = (_setting(rot, "is_neox_style"), _setting(rot, "mrope_section"),
                    _setting(rot, "mrope_interleaved", False))
        if not self.qk_norm:
            return (rot, table) + rotation
        qn, kn = member(m, "_modules", "q_norm"), member(m, "_modules", "k_norm")
        return (rot, table) + rotation + (qn, member(qn, "_parameters", "weight"), _setting(qn, "variance_epsilon"),
                                          kn, member(kn, "_parameters", "weight"), _setting(kn, "variance_epsilon"))

    def ready(self, hidden_states: Optional[torch.Tensor]) -> bool:
        """Whether this call takes the fused path (re-binding first if anything it reads changed)."""
        if self.binding.get(*self._items(hidden_states)) is None:
            return False
        if hidden_states is not None and hidden_states.dtype not in self.io_dtypes:
            self.log(f"qkvfuse: {type(self.module).__name__} runs {self.engine}'s code for {hidden_states.dtype} "
                     f"activations with q/k norm weights of another dtype")
            return False
        return True

    def _bind(self, rot, table, is_neox, sections, interleaved, qn=None, q_weight=None, q_eps=None, kn=None,
              k_weight=None, k_eps=None):
        """(Re)build the bound ops from what the layer holds now; None (and the reason, logged once) when the
        layer no longer qualifies."""
        reason = self.qualifies(self.module)
        if reason is None:
            try:
                prep = self._bound_ops(rot, table, is_neox, sections, interleaved, qn, q_weight, q_eps, k_weight)
            except (ValueError, TypeError) as exc:  # what qkvfuse's own validation refuses: the engine's code then
                reason = f"qkvfuse refuses the layer's tensors: {exc}"
        self.reason = reason
        if reason is not None:
            if self.prep is not None:  # it was fused: say that this layer now runs the engine's code
                self.log(f"qkvfuse: {type(self.module).__name__} runs {self.engine}'s code after a change to the "
                         f"running model: {reason}")
            self.prep = self.prep_1d = None
            return None
        self.prep, self.prep_1d, self.sections, self.interleaved, self.eps, self.is_neox, self.gemma = prep
        c = self.prep.config
        self.io_dtypes = served_dtypes((c.q_weight, c.k_weight, c.q_bias, c.k_bias))
        return self.prep

    def _bound_ops(self, rot, table, is_neox, sections, interleaved, qn, q_weight, q_eps, k_weight) -> tuple:
        """The bound ops and their settings: ``(prep, prep_1d, sections, interleaved, eps, is_neox, gemma)``."""
        sections = tuple(sections) if sections else None
        interleaved = bool(interleaved)
        eps = q_eps if self.qk_norm else 1e-6
        is_neox = bool(is_neox)
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
            # The module's current parameters, table and settings as the trace reads them (dynamo guards on the
            # scalars: a changed eps or rotary setting retraces). In place, as in eager mode: inductor re-inplaces
            # the op on the projection output (used by nothing else), so the graph allocates nothing for it;
            # fresh outputs would cost fresh pages per call (the functional op at T=512 ran 3-4x slower than in
            # place inside vLLM's compiled graph).
            m = self.module
            rot = m.rotary_emb
            qw, kw = (m.q_norm.weight, m.k_norm.weight) if self.qk_norm else (None, None)
            eps = m.q_norm.variance_epsilon if self.qk_norm else 1e-6
            sections = getattr(rot, "mrope_section", None)
            mrope = bool(sections) and positions.dim() == 2
            return ops.split_qkv_rmsnorm_rope_(
                qkv, positions, rot._match_cos_sin_cache_dtype(qkv), self.hq, self.hkv, self.head_dim,
                q_weight=qw, k_weight=kw, eps=eps, is_neox=bool(rot.is_neox_style),
                mrope_section=tuple(sections) if mrope else None,
                mrope_interleaved=bool(getattr(rot, "mrope_interleaved", False)), q_gate=self.q_gate,
                gemma_norm=self.qk_norm and type(m.q_norm).__name__ == "GemmaRMSNorm", backend=self.backend)
        prep = self.prep if positions.dim() == 2 or self.sections is None else self.prep_1d
        if self.verify:
            return _verified(self, prep, qkv, positions)
        return prep.inplace(qkv, positions)


def ungated(qkv: torch.Tensor, hq: int, head_dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``([q | k | v], gate)`` of a gated row ``[q_gate | k | v]`` (Q and gate interleaved per head), copies."""
    q_gate = qkv[:, : 2 * hq * head_dim].reshape(-1, hq, 2, head_dim)
    q, gate = q_gate[:, :, 0].reshape(-1, hq * head_dim), q_gate[:, :, 1].reshape(-1, hq * head_dim)
    return torch.cat([q, qkv[:, 2 * hq * head_dim :]], dim=-1), gate


def engine_prepare(module, qkv: torch.Tensor, positions: torch.Tensor, q_gate: bool = False):
    """The engine's own prepare as its modules compute it (split, ``q_norm`` / ``k_norm`` per head, the rotary
    module), on a copy of ``qkv``; ``(q, k, v[, gate])``."""
    qkv, gate = ungated(qkv, module.num_heads, module.head_dim) if q_gate else (qkv.clone(), None)
    q, k, v = qkv.split([module.q_size, module.kv_size, module.kv_size], dim=-1)
    if getattr(module, "use_qk_norm", True):
        q = module.q_norm(q.reshape(-1, module.num_heads, module.head_dim)).reshape(q.shape)
        k = module.k_norm(k.reshape(-1, module.num_kv_heads, module.head_dim)).reshape(k.shape)
    q, k = module.rotary_emb(positions, q, k)
    return (q, k, v) if gate is None else (q, k, v, gate)


def _verified(state: BoundPrepare, prep, qkv: torch.Tensor, positions: torch.Tensor):
    """The ``verify`` option: the fused result judged against a float64 oracle next to the engine's own path."""
    from ..testing import check_split_outputs, oracle_split  # only the verify option needs them

    module = state.module
    unfused = engine_prepare(module, qkv, positions, state.q_gate)
    source, gate = ungated(qkv, state.hq, state.head_dim) if state.q_gate else (qkv.clone(), None)
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
                           f"{state.engine}'s own path: {report}")
    return outs


# --------------------------------------------------------------------------------------------------------
# One decoder-layer RMSNorm.
# --------------------------------------------------------------------------------------------------------
class BoundNorm:
    """One decoder-layer RMSNorm run by qkvfuse: in place with a residual (the form the engines' fused kernels
    write). A ``GemmaRMSNorm`` (the engine's class of that name: weight centred at 0, ``1 + w`` in fp32) runs as
    ``AddRMSNorm(..., gemma_norm=True)``. The bound op is rebuilt when the weight is replaced or changes storage
    (``weight.data = ...``, ``model._apply``), so it never reads freed memory or compares against stale byte
    ranges, and when the norm's eps changes (the engine's forward reads it on every call).

    An engine subclasses it with :attr:`engine` and :meth:`log`."""

    engine = "the engine"

    def __init__(self, norm, backend: Optional[str]):
        self.norm, self.backend = norm, backend
        self.gemma = type(norm).__name__ == "GemmaRMSNorm"
        self.binding = Rebinding(self._build)

    def log(self, message: str) -> None:
        """One log line through the engine's log (once per process)."""
        raise NotImplementedError

    def _build(self, weight, eps) -> Optional[ops.AddRMSNorm]:
        try:
            return ops.AddRMSNorm(weight.detach(), eps, gemma_norm=self.gemma, backend=self.backend)
        except (ValueError, TypeError, AttributeError) as exc:  # e.g. a weight swapped for another shape
            self.log(f"qkvfuse: an RMSNorm runs {self.engine}'s code after a change to the running model: {exc}")
            return None

    def _items(self) -> tuple:
        return member(self.norm, "_parameters", "weight"), _setting(self.norm, "variance_epsilon")

    @property
    def eps(self) -> float:
        """The norm's eps now (the engine's forward reads it on every call)."""
        return self.norm.variance_epsilon

    @property
    def bound(self) -> Optional[ops.AddRMSNorm]:
        """The bound op for the norm's current weight and eps (None: the engine's code)."""
        return self.binding.get(*self._items())

    def __call__(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if torch.compiler.is_compiling():
            # In place with a residual, as the engine's fused kernel and the eager path write (inductor
            # re-inplaces it: no fresh outputs per call); without one, x is the layer's residual from then on: a
            # fresh output.
            eps = self.norm.variance_epsilon
            if residual is None:
                return ops.add_rmsnorm(x, None, self.norm.weight, eps, gemma_norm=self.gemma,
                                       backend=self.backend)[0]
            return ops.add_rmsnorm_(x, residual, self.norm.weight, eps, gemma_norm=self.gemma,
                                    backend=self.backend)
        bound = self.binding.get(*self._items())
        if bound is None or x.dtype not in served_dtypes((bound.config.weight, bound.config.bias)):
            return type(self.norm).forward(self.norm, x, residual)
        if residual is None:
            return bound(x)[0]
        return bound.inplace(x, residual)


def fuse_decoder_norms(layer, cls_name: str, untested: Optional[str], report: Report, backend: Optional[str],
                       reason_of: Callable[[object], Optional[str]], bound_norm: type, forward: Callable) -> None:
    """The two norms of one decoder layer (``input_layernorm``, ``post_attention_layernorm``): each that
    qualifies (``reason_of(norm)`` None, and ``untested`` None) gets ``bound_norm(norm, backend)`` as its
    ``_qkvfuse`` and ``forward`` (the engine's replacement) on the instance; counted in ``report``."""
    name = f"{cls_name} add+RMSNorm"
    for attr in ("input_layernorm", "post_attention_layernorm"):
        norm = getattr(layer, attr, None)
        reason = untested or (reason_of(norm) if norm is not None else f"no {attr}")
        if reason is None:
            norm._qkvfuse = bound_norm(norm, backend)
            install(norm, "forward", forward)
        report.count(name, reason, resolve_backend(backend, norm.weight.device.type) if reason is None else "")


def install(obj, name: str, function: Callable) -> None:
    """Replace ``obj.<name>`` on this instance only by ``function`` bound to it (the class keeps its code)."""
    setattr(obj, name, types.MethodType(function, obj))
