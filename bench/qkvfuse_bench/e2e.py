"""End to end: whole transformers models, patched by ``apply_qkvfuse`` vs unpatched.

``PYTHONPATH=bench python -m qkvfuse_bench.e2e [--preset NAME] [--quick] [--compile] [--json PATH] [--threads N]``
from the repository root, in ``.venv`` (``bench/README.md``).

Models. Random-weight bf16 transformers models built offline from their config classes with the *published layer
geometry* of a preset (:mod:`qkvfuse.presets`): hidden size, heads, head_dim, rotary dim and theta, QK-norm,
qkv bias, RMSNorm eps, ``max_position_embeddings``, MLP / MoE sizes; ``head_dim``, ``rope_theta`` and
``partial_rotary_factor`` always passed explicitly (the config classes' defaults differ from the published
models). Shrunk, and said so in every table: 2 layers, a 1024-token vocabulary, and for GLM-4.x 16 routed experts
(published 160; each of the published size, top-8 as published, one shared expert) with every layer an MoE layer
(published: the first 3 of 92 layers are dense). ``sdpa`` attention, a ``DynamicCache``, batch 1.

Measured (wall clock, eager and -- with ``--compile``, optional and slow -- ``torch.compile(model)`` in the
default mode with ``dynamic=False``):

* decode: ms per step of one token at a context of 128 tokens (the cache is cropped back to 128 after every step,
  so every step sees the same context and shapes), blocks of steps, unpatched and patched models alternating
  in interleaved rounds;
* prefill: ms per forward of 512 tokens into an empty cache (``logits_to_keep=1``, as ``generate`` does); the
  first (warm-up) call of each model is the checked and profiled one.

Checked: the patched model's logits against the unpatched model's (same weights, bf16) at the last prefill position
and at a decode step: ``max|patched - unpatched| / max|unpatched|`` must be finite and at most
:data:`E2E_LOGIT_RTOL` (a sanity check; the kernels' accuracy is judged op by op against a float64 oracle).

Attribution: the share of a step taken by attention-prepare (q/k RMSNorm + rotary; patched: the fused split) and
add-norm (residual add + post-attention RMSNorm; patched: ``add_rmsnorm``), two ways:

* isolated (the primary number): each sub-step timed on its own at the model's shapes with the model's own
  modules and functions -- unfused: ``q_norm``/``k_norm`` on the ``[1, T, H, D]`` projections, the transposes and
  the modeling module's ``apply_rotary_pos_emb``; ``residual + x`` and ``post_attention_layernorm``; fused: what
  the patched forwards do, with the layer's own bound ops (positions flattened, ``QKNormRope.inplace`` on a packed
  ``[T, (Hq+2Hkv)*D]`` buffer, the views; ``AddRMSNorm`` and the reshapes), validation included -- in interleaved
  rounds on hot buffers, times the number of layers, over the measured step time of the same model;
* profiler: ``torch.profiler`` over a few decode steps after the warm-up, or over the first (warm-up) prefill;
  patched: the CPU time of the ``qkvfuse::`` op events (dispatcher and kernel; the Python validation around them
  is not an event); unpatched: ``record_function`` ranges installed
  around ``q_norm``, ``k_norm``, ``apply_rotary_pos_emb`` and ``post_attention_layernorm`` for that run only, plus
  the ``aten::add`` between the end of ``self_attn`` and the start of ``post_attention_layernorm`` (the residual
  add); over the profiled wall time per step. The profiler adds a per-op cost, which weighs more on the many small
  unfused ops: read it as a cross-check of the isolated numbers.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import argparse
import json
import statistics
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from qkvfuse.presets import ModelPreset, get_preset
from qkvfuse.benchmarks.timing import Budget, Candidate, machine_info, measure

__all__ = ["E2EConfig", "E2E_MODELS", "E2E_LOGIT_RTOL", "e2e_transformers_config", "build_e2e_model",
           "run_e2e", "run_e2e_cli", "print_e2e"]

E2E_MODELS = ("Qwen3-8B", "GLM-4.7")
E2E_LOGIT_RTOL = 0.05
# The dense MLP of the GLM-4.5/4.6/4.7 configs (the presets keep the MoE sizes only; unused when every layer is MoE).
GLM_DENSE_INTERMEDIATE = 12288
_LABEL = "qkvfuse_bench::"


@dataclasses.dataclass(frozen=True)
class E2EConfig:
    """What the end-to-end bench runs (``config_changes``: overrides of the transformers config fields, for tiny tests)."""

    models: Tuple[str, ...] = E2E_MODELS
    layers: int = 2
    vocab: int = 1024
    experts: int = 16
    context: int = 128
    prefill: int = 512
    decode_steps: int = 8  # decode steps per timed block
    decode_rounds: int = 7
    prefill_rounds: int = 2  # a bf16 prefill of 512 tokens takes a minute or more on a 2-core AVX2 machine
    profile_steps: int = 4
    compile: bool = False
    seed: int = 0
    attribution_budget: Budget = Budget(block_s=5e-3, cell_s=2.0, warm_s=0.05, min_rounds=5, max_rounds=25)
    config_changes: Tuple[Tuple[str, object], ...] = ()


# --------------------------------------------------------------------------------------------------------
# Models.
# --------------------------------------------------------------------------------------------------------
def _family(preset: ModelPreset) -> str:
    if preset.mrope_section is None and preset.name.startswith("GLM") and preset.is_moe:
        return "glm4_moe"
    if preset.mrope_section is None and preset.name.startswith("Qwen3") and not preset.is_moe:
        return "qwen3"
    raise ValueError(f"--preset: {preset.name!r} is not supported; supported: the dense Qwen3 presets "
                     f"(Qwen3-8B, Qwen3-32B) and the GLM-4.x MoE text presets (GLM-4.5, GLM-4.5-Air, GLM-4.6, "
                     f"GLM-4.7)")


def e2e_transformers_config(name: str, cfg: E2EConfig):
    """The transformers config of ``name``'s e2e model and a one-line description of what was kept and shrunk."""
    import transformers

    preset = get_preset(name)
    family = _family(preset)
    fields = dict(
        vocab_size=cfg.vocab, hidden_size=preset.hidden_size, num_hidden_layers=cfg.layers,
        num_attention_heads=preset.num_q_heads, num_key_value_heads=preset.num_kv_heads, head_dim=preset.head_dim,
        rms_norm_eps=preset.rms_norm_eps, max_position_embeddings=preset.max_position,
        rope_parameters={"rope_type": "default", "rope_theta": preset.rope_theta,
                         "partial_rotary_factor": preset.partial_rotary_factor},
        attention_bias=preset.qkv_bias, tie_word_embeddings=False,
    )
    if family == "qwen3":
        fields["intermediate_size"] = preset.intermediate_size
    else:
        experts = min(cfg.experts, preset.num_experts)
        fields.update(intermediate_size=GLM_DENSE_INTERMEDIATE, moe_intermediate_size=preset.moe_intermediate_size,
                      n_routed_experts=experts, num_experts_per_tok=min(preset.num_experts_per_tok, experts),
                      n_shared_experts=preset.num_shared_experts, routed_scaling_factor=preset.routed_scaling_factor,
                      n_group=1, topk_group=1, first_k_dense_replace=0, norm_topk_prob=True,
                      use_qk_norm=preset.qk_norm)
    fields.update(dict(cfg.config_changes))
    if family == "qwen3":
        config = transformers.Qwen3Config(**fields)
    else:
        config = transformers.Glm4MoeConfig(**fields)
    config._attn_implementation = "sdpa"
    f = fields
    rotary = int(f["head_dim"] * f["rope_parameters"]["partial_rotary_factor"])
    text = (f"{f['num_hidden_layers']} layers, hidden {f['hidden_size']}, {f['num_attention_heads']}/"
            f"{f['num_key_value_heads']} heads x {f['head_dim']}, rotary {rotary} (theta "
            f"{f['rope_parameters']['rope_theta']:g}), {'QK-norm' if preset.qk_norm else 'no QK-norm'}, "
            f"{'qkv bias' if f['attention_bias'] else 'no qkv bias'}, ")
    if family == "qwen3":
        text += f"MLP {f['intermediate_size']}"
    else:
        text += (f"MoE every layer: {f['n_routed_experts']} routed experts (published {preset.num_experts}) x "
                 f"{f['moe_intermediate_size']}, top-{f['num_experts_per_tok']}, {f['n_shared_experts']} shared "
                 f"(published: first {preset.first_k_dense_replace} layers dense)")
    text += f"; vocab {f['vocab_size']}; random weights, bf16, sdpa"
    if cfg.config_changes:
        text += f"; SHRUNK for a smoke run: {dict(cfg.config_changes)}"
    return config, text


def build_e2e_model(name: str, cfg: E2EConfig):
    """``(model, description)``: the random-weight bf16 model (eval mode), built with ``dtype=`` at construction."""
    import transformers

    config, text = e2e_transformers_config(name, cfg)
    cls = transformers.Qwen3ForCausalLM if _family(get_preset(name)) == "qwen3" else transformers.Glm4MoeForCausalLM
    torch.manual_seed(cfg.seed)
    model = cls._from_config(config, dtype=torch.bfloat16).eval()
    experts = getattr(model.config, "_experts_implementation", None)
    if experts and _family(get_preset(name)) == "glm4_moe":
        text += f"; experts implementation {experts}"
    return model, text


# --------------------------------------------------------------------------------------------------------
# Timed calls.
# --------------------------------------------------------------------------------------------------------
def _ids(length: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, length), generator=g)


def _decode_step(model, run, context_ids: torch.Tensor, token: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A decode step at a fixed context: prefill ``context_ids`` once; each call decodes ``token`` and crops the
    cache back (``run`` is ``model`` or its compiled form)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    run(input_ids=context_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)

    def step():
        logits = run(input_ids=token, past_key_values=cache, use_cache=True).logits
        cache.crop(-1)
        return logits
    return step


def _prefill(model, run, prompt: torch.Tensor) -> Callable[[], torch.Tensor]:
    from transformers import DynamicCache

    def call():
        cache = DynamicCache(config=model.config)
        return run(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    return call


def _interleaved(calls: Dict[str, Callable[[], object]], rounds: int, per_block: int) -> Dict[str, List[float]]:
    """Per-round ms per call of each entry, the order reversed every other round."""
    names = list(calls)
    times: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            for _ in range(per_block):
                calls[n]()
            times[n].append((time.perf_counter() - t0) * 1e3 / per_block)
    return times


def _logit_error(got: torch.Tensor, ref: torch.Tensor) -> Tuple[float, bool]:
    got, ref = got.detach().double()[..., -1, :], ref.detach().double()[..., -1, :]
    if not bool(torch.isfinite(got).all()):
        return float("inf"), False
    err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    return err, bool(torch.equal(got.argmax(-1), ref.argmax(-1)))


# --------------------------------------------------------------------------------------------------------
# Attribution: the sub-steps in isolation.
# --------------------------------------------------------------------------------------------------------
def _substeps(unpatched, patched, T: int, position: int) -> Dict[str, Callable[[], object]]:
    """Zero-argument calls of the four sub-steps of layer 0 at ``T`` tokens from ``position`` (see the module doc)."""
    from qkvfuse.integrations.transformers import _flat_positions

    layer, p_layer = unpatched.model.layers[0], patched.model.layers[0]
    attn, p_attn = layer.self_attn, p_layer.self_attn
    modeling = sys.modules[type(attn).__module__]
    rotary_fn = modeling.apply_rotary_pos_emb
    config = unpatched.config
    H, hq, hkv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, attn.head_dim
    g = torch.Generator().manual_seed(T)
    dtype = torch.bfloat16

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    q, k, v = randn(1, T, hq * d), randn(1, T, hkv * d), randn(1, T, hkv * d)
    position_ids = torch.arange(position, position + T)[None]
    cos, sin = unpatched.model.rotary_emb(q, position_ids)
    qk_norm = getattr(attn, "use_qk_norm", True) and hasattr(attn, "q_norm")
    hidden_shape = (1, T, -1, d)

    def unfused_prepare():
        qs, ks = q.view(hidden_shape), k.view(hidden_shape)
        if qk_norm:
            qs, ks = attn.q_norm(qs), attn.k_norm(ks)
        qs, ks, vs = qs.transpose(1, 2), ks.transpose(1, 2), v.view(hidden_shape).transpose(1, 2)
        return rotary_fn(qs, ks, cos, sin), vs

    # The fused side mirrors the patched forwards (integrations.transformers: _fused_attention_forward from the
    # packed projection on, _fused_decoder_forward around the post-attention norm), with the layer's own bound ops.
    fused, fused_layer = p_attn._qkvfuse, p_layer._qkvfuse
    mrope = fused.rope.mrope_section is not None
    qkv = randn(T, (hq + 2 * hkv) * d)

    def fused_prepare():
        positions = _flat_positions(position_ids, 1, T, mrope)
        qo, ko, vo = fused.bound(p_attn, qkv.device).inplace(qkv, positions)
        return (qo.view(1, T, hq, d).transpose(-3, -2), ko.view(1, T, hkv, d).transpose(-3, -2),
                vo.view(1, T, hkv, d).transpose(-3, -2))

    residual, attn_out = randn(1, T, H), randn(1, T, H)
    norm, p_norm = layer.post_attention_layernorm, p_layer.post_attention_layernorm

    def unfused_addnorm():
        hidden = residual + attn_out
        return norm(hidden), hidden

    def fused_addnorm():
        shape = attn_out.shape
        normed, res = fused_layer.bound(p_norm)(attn_out.reshape(-1, shape[-1]), residual.reshape(-1, shape[-1]))
        return normed.view(shape), res.view(shape)

    return {"unfused prepare": unfused_prepare, "fused prepare": fused_prepare,
            "unfused add-norm": unfused_addnorm, "fused add-norm": fused_addnorm}


def _isolated_us(unpatched, patched, T: int, position: int, budget: Budget) -> Dict[str, float]:
    calls = _substeps(unpatched, patched, T, position)
    src = torch.randn(1, T, unpatched.config.hidden_size).to(torch.bfloat16)
    dst = torch.empty_like(src)
    results = measure([Candidate(name, "", [fn]) for name, fn in calls.items()], [lambda: dst.copy_(src)], budget)
    return {name: results[f"{name} []"].us for name in calls}


# --------------------------------------------------------------------------------------------------------
# Attribution: the profiler.
# --------------------------------------------------------------------------------------------------------
def _labelled(label: str, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(_LABEL + label):
            return fn(*args, **kwargs)
    return wrapper


@contextlib.contextmanager
def _labels(model):
    """``record_function`` ranges around the unfused sub-steps of every layer (for one profiled run)."""
    restore: List[Callable[[], None]] = []
    try:
        for layer in model.model.layers:
            attn = layer.self_attn
            modules = [("self_attn", attn), ("post_attention_norm", layer.post_attention_layernorm)]
            if getattr(attn, "use_qk_norm", True) and hasattr(attn, "q_norm"):
                modules += [("qk_norm", attn.q_norm), ("qk_norm", attn.k_norm)]
            for label, module in modules:
                if "forward" in vars(module):
                    raise RuntimeError(f"{type(module).__name__} already has an instance forward")
                module.forward = _labelled(label, module.forward)
                restore.append(lambda m=module: delattr(m, "forward"))
        modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
        original = modeling.apply_rotary_pos_emb
        modeling.apply_rotary_pos_emb = _labelled("rotary", original)
        restore.append(lambda: setattr(modeling, "apply_rotary_pos_emb", original))
        yield
    finally:
        for undo in reversed(restore):
            undo()


def _profiled(call: Callable[[], object], steps: int, labelled_model=None) -> Tuple[Dict[str, float], object]:
    """ms per step under the profiler: wall time, prepare and add-norm CPU time (see the module doc); and the
    last call's result."""
    from torch.profiler import ProfilerActivity, profile

    ctx = _labels(labelled_model) if labelled_model is not None else contextlib.nullcontext()
    with ctx, profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            result = call()
        wall_ms = (time.perf_counter() - t0) * 1e3
    events = list(prof.events())
    prepare = addnorm = 0.0
    if labelled_model is None:
        for e in events:
            if e.name.startswith("qkvfuse::split_qkv_rmsnorm_rope"):
                prepare += e.cpu_time_total
            elif e.name.startswith("qkvfuse::add_rmsnorm"):
                addnorm += e.cpu_time_total
    else:
        attn_ends: Dict[int, List[float]] = {}
        for e in events:
            if e.name in (_LABEL + "qk_norm", _LABEL + "rotary"):
                prepare += e.cpu_time_total
            elif e.name == _LABEL + "post_attention_norm":
                addnorm += e.cpu_time_total
            elif e.name == _LABEL + "self_attn":
                attn_ends.setdefault(e.thread, []).append(e.time_range.end)
        norms = [e for e in events if e.name == _LABEL + "post_attention_norm"]
        for n in norms:  # the residual add: between the attention's end and the norm's start, on that thread
            ends = [t for t in attn_ends.get(n.thread, []) if t <= n.time_range.start]
            if not ends:
                continue
            lo = max(ends)
            addnorm += sum(e.cpu_time_total for e in events
                           if e.name == "aten::add" and e.thread == n.thread and e.time_range.start >= lo
                           and e.time_range.end <= n.time_range.start)
    return {"wall_ms": wall_ms / steps, "prepare_ms": prepare / 1e3 / steps,
            "addnorm_ms": addnorm / 1e3 / steps}, result


# --------------------------------------------------------------------------------------------------------
# One model.
# --------------------------------------------------------------------------------------------------------
def _model_rows(name: str, cfg: E2EConfig, log: Callable[[str], None]) -> Dict[str, object]:
    from qkvfuse.integrations.transformers import apply_qkvfuse

    t0 = time.perf_counter()
    unpatched, description = build_e2e_model(name, cfg)
    patched = apply_qkvfuse(copy.deepcopy(unpatched))
    log(f"  {name}: built both models in {time.perf_counter() - t0:.1f} s ({description})")
    vocab = unpatched.config.vocab_size
    context_ids, token = _ids(cfg.context, vocab, cfg.seed), _ids(1, vocab, cfg.seed + 1)
    prompt = _ids(cfg.prefill, vocab, cfg.seed + 2)
    models = {"unpatched": unpatched, "patched": patched}
    timing_rows: List[Dict[str, object]] = []
    attribution: List[Dict[str, object]] = []
    modes = [("eager", None)] + ([("torch.compile", "compile")] if cfg.compile else [])
    for mode, how in modes:
        runs, compile_s, error = {}, {}, ""
        for variant, model in models.items():
            if how is None:
                runs[variant] = model
                continue
            try:
                runs[variant] = torch.compile(model, dynamic=False)
            except Exception as exc:  # noqa: BLE001 -- a failed compile is a finding for the table
                error = f"{type(exc).__name__}: {exc}"
        for phase in ("decode", "prefill"):
            row: Dict[str, object] = {"model": name, "phase": f"decode (ctx {cfg.context})" if phase == "decode" else
                                      f"prefill ({cfg.prefill})", "mode": mode}
            try:
                if error:
                    raise RuntimeError(error)
                t1 = time.perf_counter()
                calls, first, profiles = {}, {}, {}
                for variant, model in models.items():
                    t2 = time.perf_counter()
                    calls[variant] = (_decode_step(model, runs[variant], context_ids, token) if phase == "decode"
                                      else _prefill(model, runs[variant], prompt))
                    if phase == "prefill" and how is None:
                        # A prefill costs seconds to minutes here: its first call (the warm-up, checked below) is
                        # also the profiled one.
                        profiles[variant], first[variant] = _profiled(
                            calls[variant], 1, labelled_model=model if variant == "unpatched" else None)
                    else:
                        first[variant] = calls[variant]()  # warm-up (the compile, under torch.compile); checked
                    compile_s[(phase, variant)] = time.perf_counter() - t2
                    if phase == "decode":
                        calls[variant]()
                err, same_top1 = _logit_error(first["patched"], first["unpatched"])
                rounds, per_block = ((cfg.decode_rounds, cfg.decode_steps) if phase == "decode"
                                     else (cfg.prefill_rounds, 1))
                times = _interleaved(calls, rounds, per_block)
                un, pa = statistics.median(times["unpatched"]), statistics.median(times["patched"])
                speedup = statistics.median(u / p for u, p in zip(times["unpatched"], times["patched"]))
                ok = err <= E2E_LOGIT_RTOL
                row.update({"unpatched ms": un, "patched ms": pa, "speedup": speedup, "saved ms": un - pa,
                            "rounds": rounds, "steps/block": per_block, "logit err": err,
                            "same top-1": "yes" if same_top1 else "no",
                            "check": "ok" if ok else f"FAIL: logit error {err:.3g}", "pass": ok})
                if how is not None:
                    row["compile s"] = " / ".join(f"{compile_s[(phase, v)]:.0f}" for v in models)
                log(f"  {name} {mode} {phase}: {un:.2f} -> {pa:.2f} ms in {time.perf_counter() - t1:.0f} s")
                if how is None:
                    attribution += _attribute(name, phase, cfg, unpatched, patched, calls, profiles, un, pa, log)
            except Exception as exc:  # noqa: BLE001 -- report, keep the other rows
                traceback.print_exc()
                row.update({"check": f"FAIL: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                            "pass": False})
            timing_rows.append(row)
    del models, patched, unpatched
    gc.collect()
    return {"model": name, "description": description, "timing": timing_rows, "attribution": attribution}


def _attribute(name, phase, cfg, unpatched, patched, calls, profiles, un_ms, pa_ms,
               log) -> List[Dict[str, object]]:
    t0 = time.perf_counter()
    T, position = (1, cfg.context) if phase == "decode" else (cfg.prefill, 0)
    layers = unpatched.config.num_hidden_layers
    iso = _isolated_us(unpatched, patched, T, position, cfg.attribution_budget)
    prof = profiles or {"unpatched": _profiled(calls["unpatched"], cfg.profile_steps, labelled_model=unpatched)[0],
                        "patched": _profiled(calls["patched"], cfg.profile_steps)[0]}
    rows = []
    for variant, step, kind in (("unpatched", un_ms, "unfused"), ("patched", pa_ms, "fused")):
        prep, addn = iso[f"{kind} prepare"] * layers / 1e3, iso[f"{kind} add-norm"] * layers / 1e3
        p = prof[variant]
        rows.append({"model": name, "phase": phase, "variant": variant, "step ms": step,
                     "prepare ms": prep, "add-norm ms": addn, "share": (prep + addn) / step,
                     "prof step ms": p["wall_ms"], "prof prepare ms": p["prepare_ms"],
                     "prof add-norm ms": p["addnorm_ms"],
                     "prof share": (p["prepare_ms"] + p["addnorm_ms"]) / p["wall_ms"], "pass": True})
    log(f"  {name} {phase}: attribution in {time.perf_counter() - t0:.0f} s")
    return rows


# --------------------------------------------------------------------------------------------------------
# The section.
# --------------------------------------------------------------------------------------------------------
def run_e2e(cfg: E2EConfig, log: Callable[[str], None] = print) -> List[Dict[str, object]]:
    """One result per model: its description, timing rows (decode, prefill; eager and optionally compiled) and
    attribution rows (eager)."""
    import warnings

    results = []
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*functools.lru_cache.*")
        if cfg.compile:
            # two models x prefill/decode x the graph breaks of the MoE loop: more than dynamo's default limit
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        for name in cfg.models:
            results.append(_model_rows(name, cfg, log))
    return results


def _ms(x) -> str:
    return "" if x is None else (f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 100 else f"{x:.0f}")


def _pct(x) -> str:
    return "" if x is None else (f"{100 * x:.3f}%" if x < 0.01 else f"{100 * x:.2f}%" if x < 0.1 else
                                 f"{100 * x:.1f}%")


def print_e2e(results: Sequence[Dict[str, object]], cfg: E2EConfig) -> int:
    """Print the tables; the number of failed rows."""
    from qkvfuse._verify.sections import Section, print_section

    failures = 0
    for res in results:
        cells = []
        for r in res["timing"]:
            failures += not r.get("pass", False)
            cells.append({**r, **{k: _ms(r.get(k)) for k in ("unpatched ms", "patched ms", "saved ms")},
                          "speedup": f"{r['speedup']:.3f}x" if "speedup" in r else "",
                          "logit err": f"{r['logit err']:.2g}" if "logit err" in r else "",
                          "check": str(r.get("check", "")).split(":")[0]})
        columns = ("phase", "mode", "unpatched ms", "patched ms", "speedup", "saved ms", "rounds", "steps/block",
                   "logit err", "same top-1", "check") + (("compile s",) if cfg.compile else ())
        note = (f"{res['description']}.\nms: median over interleaved rounds of ms per step (decode: blocks of "
                f"{cfg.decode_steps} steps; the cache cropped back to {cfg.context} after each step); speedup: median "
                f"of per-round unpatched/patched;\nlogit err: max|patched - unpatched| / max|unpatched| of the logits "
                f"(last position), check: <= {E2E_LOGIT_RTOL:g}"
                + ("; compile s: first call (compile) of unpatched / patched" if cfg.compile else ""))
        print_section(Section(f"end to end: {res['model']} geometry, batch 1", columns, cells, note))
        if res["attribution"]:
            a_cells = [{**r, **{k: _ms(r[k]) for k in ("step ms", "prepare ms", "add-norm ms", "prof step ms",
                                                     "prof prepare ms", "prof add-norm ms")},
                        "share": _pct(r["share"]), "prof share": _pct(r["prof share"])} for r in res["attribution"]]
            a_note = ("eager. prepare: q/k RMSNorm + rotary (unpatched) or the fused split (patched); add-norm: "
                      "residual add + post-attention RMSNorm or add_rmsnorm;\nms per step = all layers. Isolated: each "
                      "sub-step timed alone at the model's shapes (hot buffers, validation included) x layers, share "
                      "= over step ms.\nprof: torch.profiler CPU time (unpatched: record_function ranges + the "
                      "residual aten::add; patched: the qkvfuse:: op events, no validation)\nover the profiled wall "
                      "time per step; the profiler's per-op cost inflates the many small unfused ops.")
            print_section(Section(f"end to end: {res['model']}: share of a step in attention-prepare and add-norm",
                                  ("phase", "variant", "step ms", "prepare ms", "add-norm ms", "share",
                                   "prof step ms", "prof prepare ms", "prof add-norm ms", "prof share"),
                                  a_cells, a_note))
    return failures


def config_from_args(args) -> E2EConfig:
    models = tuple(get_preset(n).name for n in (args.preset or E2E_MODELS))
    for name in models:
        _family(get_preset(name))
    cfg = E2EConfig(models=models, compile=bool(getattr(args, "compile", False)))
    if args.quick:
        cfg = dataclasses.replace(cfg, decode_rounds=3, prefill_rounds=1, decode_steps=4, profile_steps=2,
                                  attribution_budget=Budget(block_s=2e-3, cell_s=0.5, warm_s=0.02, min_rounds=3,
                                                            max_rounds=9))
    return cfg


def main(argv: Optional[List[str]] = None) -> int:
    """Run the end-to-end bench: 0, 1 when a row failed (a check or an exception), 2 for bad flags."""
    from qkvfuse.benchmarks.report import configure, print_machine, unwritable

    parser = argparse.ArgumentParser(prog="python -m qkvfuse_bench.e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", action="append",
                        help=f"only these models (repeatable; default {', '.join(E2E_MODELS)})")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    parser.add_argument("--compile", action="store_true",
                        help="also torch.compile both models (slow: minutes per model)")
    parser.add_argument("--json", help="write the results here (an unwritable path is an error before the run)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads(N) first (default: torch's choice)")
    args = parser.parse_args(argv)
    problem = unwritable(args.json) if args.json else ""
    if problem:  # checked first: a long run would otherwise lose its rows at the end
        print(f"e2e: --json {args.json}: {problem}", file=sys.stderr)
        return 2
    cfg, code = configure(args, config_from_args)
    if code is not None:
        return code
    t0 = time.perf_counter()
    machine = machine_info()
    print_machine(machine)
    print(f"end to end: {', '.join(cfg.models)}; eager" + (" and torch.compile (slow)" if cfg.compile else
                                                           " (torch.compile: --compile)"), flush=True)
    results = run_e2e(cfg, log=lambda line: print(line, flush=True))
    failures = print_e2e(results, cfg)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine, "config": dataclasses.asdict(cfg), "results": results}, fh, indent=1,
                      default=str)
    print(f"\nbench --e2e: {failures} failed rows in {time.perf_counter() - t0:.0f} s"
          + (f"; wrote {args.json}" if args.json else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
