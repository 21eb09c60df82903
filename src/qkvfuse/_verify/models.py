"""Model-level checks of the transformers integration, logits to logits (the ``models`` section of verify).

Each check builds a tiny random-weight model of one family (:mod:`.tiny_models`), runs it unpatched and
patched by :func:`~qkvfuse.integrations.transformers.apply_qkvfuse`, and compares with the tolerances of
:mod:`qkvfuse.testing.accuracy`:

* :func:`check_prefill` -- fp32 prefill logits (a batch of two prompts, or one prompt with an image);
* :func:`check_generation` -- fp32 greedy generation with the KV cache: identical tokens, per-step logits;
* :func:`check_bf16` -- bf16 prefill; patched and unpatched bf16 both judged against the model in float64;
* :func:`check_padded_batch` -- two left-padded prompts of different lengths vs each prompt alone;
* :func:`check_undo` -- :func:`remove_qkvfuse` restores bit-identical logits.

The tests in ``tests/integrations`` call the same functions, so ``verify`` and the tests agree by construction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from typing import Dict, List, Optional

import torch

from ..backends import resolve_backend
from ..testing.accuracy import MODEL_BF16_MAX_FACTOR, MODEL_BF16_RMS_FACTOR, MODEL_FP32_LOGIT_RTOL
from .sections import Options, Section, advance, planned
from .tiny_models import TINY_MODELS, build_tiny_model, clone_model, tiny_image_prompt, tiny_prompt

__all__ = ["ModelReport", "check_prefill", "check_generation", "check_bf16", "check_padded_batch", "check_undo",
           "model_inputs", "relative_error", "section", "single_thread"]


@dataclasses.dataclass
class ModelReport:
    """Outcome of one model-level check.

    ``max_err``: fp32 checks -- ``max|patched - unpatched| / max|unpatched|``; bf16 -- ``max|patched - fp64|``.
    ``ref_err``: bf16 only -- ``max|unpatched bf16 - fp64|`` (None otherwise). ``tokens_identical``: generation
    checks only.
    """

    ok: bool
    max_err: float
    ref_err: Optional[float] = None
    tokens_identical: Optional[bool] = None
    detail: str = ""

    def __bool__(self) -> bool:
        return self.ok


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|got - ref| / max|ref|`` in float64; ``inf`` when ``got`` has a non-finite value ``ref`` has not."""
    got, ref = got.detach().double(), ref.detach().double()
    if (torch.isfinite(ref) & ~torch.isfinite(got)).any():
        return float("inf")
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def model_inputs(model: torch.nn.Module, name: str, batch: int = 2, length: int = 12, seed: int = 0) -> Dict:
    """Prefill inputs: one prompt with an image for multimodal families, else ``batch`` text prompts."""
    if TINY_MODELS[name].image:
        return tiny_image_prompt(model, seed=seed)
    return {"input_ids": tiny_prompt(batch, length, seed=seed)}


def _patch(model, backend):
    from ..integrations.transformers import apply_qkvfuse

    return apply_qkvfuse(model, backend=backend)


def _unpatch(model):
    from ..integrations.transformers import remove_qkvfuse

    return remove_qkvfuse(model)


@torch.no_grad()
def _logits(model, inputs) -> torch.Tensor:
    return model(**inputs).logits


def check_prefill(name: str, *, backend: Optional[str] = None, seed: int = 0, model=None,
                  inputs: Optional[Dict] = None) -> ModelReport:
    """fp32 prefill logits of the patched model within ``MODEL_FP32_LOGIT_RTOL`` of the unpatched model's."""
    model = model if model is not None else build_tiny_model(name, seed=seed)
    inputs = inputs if inputs is not None else model_inputs(model, name, seed=seed)
    ref = _logits(model, inputs)
    _patch(model, backend)
    try:
        got = _logits(model, inputs)
    finally:
        _unpatch(model)
    err = relative_error(got, ref)
    ok = err <= MODEL_FP32_LOGIT_RTOL
    return ModelReport(ok, err, detail="" if ok else f"relative logit error {err:.3g} > {MODEL_FP32_LOGIT_RTOL:g}")


@torch.no_grad()
def _generate(model, inputs, new_tokens: int, **kwargs):
    # min_new_tokens: an EOS drawn by a random model must not end one run early.
    return model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, **kwargs)


def check_generation(name: str, *, new_tokens: int = 24, backend: Optional[str] = None, seed: int = 0,
                     model=None, inputs: Optional[Dict] = None,
                     cache_implementation: Optional[str] = None) -> ModelReport:
    """fp32 greedy generation with the KV cache: identical tokens, every step's logits within the fp32 rtol.

    ``cache_implementation``: transformers' cache (``None``: dynamic; ``"static"``: preallocated).
    """
    model = model if model is not None else build_tiny_model(name, seed=seed)
    inputs = inputs if inputs is not None else model_inputs(model, name, batch=1, length=8, seed=seed)
    cache = {"cache_implementation": cache_implementation} if cache_implementation else {}
    ref = _generate(model, inputs, new_tokens, **cache)
    _patch(model, backend)
    try:
        got = _generate(model, inputs, new_tokens, **cache)
    finally:
        _unpatch(model)
    same = got.sequences.shape == ref.sequences.shape and torch.equal(got.sequences, ref.sequences)
    # After a divergence the two runs see different prefixes: compare logits up to the first differing step.
    steps = len(ref.logits)
    if not same:
        prompt = inputs["input_ids"].shape[1]
        diff = (got.sequences[:, prompt:] != ref.sequences[:, prompt:]).any(0).nonzero()
        steps = int(diff[0]) + 1 if len(diff) else min(len(got.logits), len(ref.logits))
    err = max(relative_error(g, r) for g, r in zip(got.logits[:steps], ref.logits[:steps]))
    ok = same and err <= MODEL_FP32_LOGIT_RTOL
    detail = "" if same else f"tokens differ from step {steps - 1}"
    if err > MODEL_FP32_LOGIT_RTOL:
        detail = "; ".join(filter(None, [detail, f"step logits relative error {err:.3g} > {MODEL_FP32_LOGIT_RTOL:g}"]))
    return ModelReport(ok, err, tokens_identical=same, detail=detail)


def check_bf16(name: str, *, backend: Optional[str] = None, seed: int = 0) -> ModelReport:
    """bf16 prefill: the patched model's error against float64 is no larger than the unpatched bf16 model's.

    Errors are over all logits against the same weights run in float64; the rule allows
    ``MODEL_BF16_RMS_FACTOR`` on the RMS error and ``MODEL_BF16_MAX_FACTOR`` on the max error.
    """
    model = build_tiny_model(name, dtype=torch.bfloat16, seed=seed)
    reference = clone_model(model, torch.float64)
    inputs = model_inputs(model, name, seed=seed)
    inputs64 = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    exact = _logits(reference, inputs64)
    unpatched = _logits(model, inputs).double()
    _patch(model, backend)
    try:
        patched = _logits(model, inputs).double()
    finally:
        _unpatch(model)
    if not torch.isfinite(patched).all():
        return ModelReport(False, float("inf"), detail="non-finite patched logits")
    max_p, max_u = float((patched - exact).abs().max()), float((unpatched - exact).abs().max())
    rms_p, rms_u = (float((x - exact).pow(2).mean().sqrt()) for x in (patched, unpatched))
    problems = []
    if rms_p > MODEL_BF16_RMS_FACTOR * rms_u:
        problems.append(f"RMS error {rms_p:.3g} > {MODEL_BF16_RMS_FACTOR} x unpatched {rms_u:.3g}")
    if max_p > MODEL_BF16_MAX_FACTOR * max_u:
        problems.append(f"max error {max_p:.3g} > {MODEL_BF16_MAX_FACTOR} x unpatched {max_u:.3g}")
    detail = "; ".join(problems) or f"RMS error {rms_p:.3g} vs unpatched {rms_u:.3g}"
    return ModelReport(not problems, max_p, ref_err=max_u, detail=detail)


def check_padded_batch(name: str, *, lengths=(9, 5), backend: Optional[str] = None, seed: int = 0,
                       new_tokens: int = 6) -> ModelReport:
    """Two left-padded prompts of different lengths, patched, vs each prompt alone unpatched.

    Prefill logits at every real token must match per sequence (fp32 rtol); then a greedy continuation of the
    padded batch must give the same tokens patched and unpatched. Positions are passed the way ``generate``
    builds them for left padding (``cumsum(mask) - 1``).
    """
    model = build_tiny_model(name, seed=seed)
    prompts = [tiny_prompt(1, n, seed=seed + i)[0] for i, n in enumerate(lengths)]
    width = max(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    alone = [_logits(model, {"input_ids": p[None]})[0] for p in prompts]
    batch = {"input_ids": ids, "attention_mask": mask}
    ref_tokens = _generate(model, batch, new_tokens).sequences
    _patch(model, backend)
    try:
        padded = _logits(model, {**batch, "position_ids": positions})
        tokens = _generate(model, batch, new_tokens).sequences
    finally:
        _unpatch(model)
    err = max(relative_error(padded[row, width - len(p):], alone[row]) for row, p in enumerate(prompts))
    same = torch.equal(tokens, ref_tokens)
    ok = err <= MODEL_FP32_LOGIT_RTOL and same
    detail = "" if ok else f"per-sequence relative error {err:.3g}, continuation tokens identical: {same}"
    return ModelReport(ok, err, tokens_identical=same, detail=detail)


def check_undo(name: str, *, backend: Optional[str] = None, seed: int = 0) -> ModelReport:
    """After apply + forward + remove, the model's logits are bit-identical to before the patch."""
    model = build_tiny_model(name, seed=seed)
    inputs = model_inputs(model, name, seed=seed)
    before = _logits(model, inputs)
    _patch(model, backend)
    _logits(model, inputs)
    _unpatch(model)
    after = _logits(model, inputs)
    same = torch.equal(before, after)
    return ModelReport(same, relative_error(after, before), detail="" if same else "logits changed after undo")


# --------------------------------------------------------------------------------------------------------
# The verify section.
# --------------------------------------------------------------------------------------------------------
def _plan(quick: bool) -> List[tuple]:
    """(family, dtype) rows; both plans hold a Qwen3-VL image row and a GLM-4.7 generation row."""
    if quick:
        return [("Qwen3-VL", "fp32"), ("GLM-4.7", "fp32"), ("GLM-4.7", "bf16")]
    return [(name, dtype) for dtype in ("fp32", "bf16") for name in TINY_MODELS]


def _fp32_row(name: str, backend: Optional[str]) -> ModelReport:
    """Prefill (every token's logits) and 24 greedy steps on one model: the worse of the two errors."""
    model = build_tiny_model(name)
    prefill = check_prefill(name, backend=backend, model=model)
    generation = check_generation(name, backend=backend, model=model)
    detail = "; ".join(filter(None, [prefill.detail, generation.detail]))
    return ModelReport(prefill.ok and generation.ok, max(prefill.max_err, generation.max_err),
                       tokens_identical=generation.tokens_identical, detail=detail)


def section(opts: Options) -> Section:
    """``models`` section of ``python -m qkvfuse verify``: each family's tiny model, patched vs unpatched."""
    try:
        import transformers  # noqa: F401  (the section needs it; report its absence as a note)
    except ImportError as exc:
        return Section("models (transformers integration)", ("family", "pass"), [],
                       note=f"skipped: transformers is not installed ({exc})")
    backend = opts.backends[0] if opts.backends else None
    plan = _plan(opts.quick)
    planned(len(plan))
    rows = []
    with single_thread():
        for name, dtype in plan:
            rows.append(_row(name, dtype, backend))
            advance()
    resolved = resolve_backend(backend, "cpu")
    note = (f"tiny random-weight models (head_dim 128, published Hq/Hkv ratio, 2 layers; gated Qwen3-Next / "
            f"Qwen3.5: head_dim 256, 3 Gated DeltaNet + 1 full-attention layer); backend: "
            f"{resolved}{'' if backend else ' (auto)'}\n"
            f"fp32: max|patched - unpatched| / max|unpatched| <= {MODEL_FP32_LOGIT_RTOL:g} "
            f"(generation: every step, greedy tokens identical); bf16: errors vs the same weights in float64, "
            f"RMS <= {MODEL_BF16_RMS_FACTOR} x and max <= {MODEL_BF16_MAX_FACTOR} x the unpatched bf16 model's")
    columns = ("family", "class", "dtype", "check", "max logit err", "unpatched err", "tokens identical", "pass", "s")
    return Section("models (transformers integration, logits to logits)", columns, rows, note)


@contextlib.contextmanager
def single_thread():
    """Run tiny models on one intra-op thread: at these sizes a second thread costs 5-20x in CPU time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _row(name: str, dtype: str, backend: Optional[str]) -> Dict[str, object]:
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' generation notices; failures are in the rows
        try:
            report = _fp32_row(name, backend) if dtype == "fp32" else check_bf16(name, backend=backend)
        except Exception as exc:  # a crash is a failed row, not a failed verify run
            report = ModelReport(False, float("nan"), detail=f"{type(exc).__name__}: {exc}")
    image = " + image" if TINY_MODELS[name].image else ""
    check = f"prefill + generate 24{image}" if dtype == "fp32" else f"prefill vs fp64{image}"
    return {
        "family": name, "class": TINY_MODELS[name].model_class, "dtype": dtype, "check": check,
        "max logit err": report.max_err, "unpatched err": "-" if report.ref_err is None else report.ref_err,
        "tokens identical": "-" if report.tokens_identical is None else ("yes" if report.tokens_identical else "NO"),
        "pass": report.ok, "detail": report.detail, "s": round(time.perf_counter() - t0, 2),
    }
