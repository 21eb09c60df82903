"""Run vLLM-CPU engines on tiny random-weight models (pytest helpers for tests/integrations/in_vllm)."""

from __future__ import annotations

import gc
import json
import os
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

# vLLM-CPU offline, in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps the engine core in this process, so
# a test sees the model and can count calls); a 1 GiB KV cache; no thread pinning (a shared 2-core machine).
OFFLINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

# Several concurrent requests of different lengths; with a 16-token step budget the long ones are prefilled in
# chunks while the short ones decode, so steps mix prefill and decode tokens.
PROMPTS: Tuple[Tuple[int, ...], ...] = tuple(tuple((7 * i + 3 * n) % 200 + 3 for i in range(n)) for n in (5, 11, 17, 40))
STEP_TOKENS = 16
NEW_TOKENS = 8


def save_tiny_model(name: str, path: str, seed: int = 0) -> str:
    """Save the tiny random-weight transformers model ``name`` (qkvfuse._verify.tiny_models) to ``path``."""
    from qkvfuse._verify.tiny_models import build_tiny_model

    if not os.path.exists(os.path.join(path, "config.json")):
        build_tiny_model(name, dtype=torch.float32, seed=seed).save_pretrained(path)
    return path


def tiny_qwen3_next_config():
    """The tiny Qwen3-Next of :mod:`qkvfuse._verify.tiny_models` at sizes vLLM-CPU runs: hidden 256, 4 layers (3
    Gated DeltaNet + 1 full attention: 8/1 heads of 256, rotary 64, theta 1e7, Gemma QK-norm, gated Q), 4 experts
    all routed per token (softmax top-k has no near-tie to flip between runs) + a shared expert, linear-attention
    head dims 128 (vLLM-CPU's Gated DeltaNet refuses smaller ones: "Unexpected head dim size"; it also needs bf16)."""
    from qkvfuse._verify.tiny_models import tiny_config

    config = tiny_config("Qwen3-Next", hidden_size=256, num_experts=4, experts_per_tok=4)
    config.linear_key_head_dim = config.linear_value_head_dim = 128
    return config


def save_tiny_qwen3_next(path: str, seed: int = 0) -> str:
    """Save the random-weight model of :func:`tiny_qwen3_next_config` (built by ``build_tiny_model``: norm weights,
    centred at 0, perturbed) to ``path``."""
    from qkvfuse._verify.tiny_models import build_tiny_model

    if not os.path.exists(os.path.join(path, "config.json")):
        build_tiny_model("Qwen3-Next", dtype=torch.float32, seed=seed, config=tiny_qwen3_next_config()
                         ).save_pretrained(path)
        # The published config.json's field that transformers 5.19's class does not keep (layer_types replaced
        # it) and SGLang's own Qwen3-Next config reads.
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config["full_attention_interval"] = 4
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
    return path


class Run(NamedTuple):
    tokens: List[List[int]]  # greedy tokens per prompt
    logprobs: List[List[float]]  # the chosen tokens' logprobs
    gaps: List[List[float]]  # logprob(chosen) - logprob(runner-up) per step: how close greedy was to a tie
    fused: Optional[Dict[str, int]]  # fused_layers() of the engine's model (None when not inspected)
    probed: object = None  # probe(model) after the generation (generate's probe), else None
    cached_tokens: Optional[List[int]] = None  # per prompt, its tokens served from vLLM's prefix cache


def generate(model_dir: str, dtype: str, qkvfuse: Optional[dict], prompts: Sequence[Sequence[int]] = PROMPTS,
             new_tokens: int = NEW_TOKENS, inspect: bool = True, setup=None, probe=None, rounds: int = 1,
             **llm_kwargs) -> Run:
    """Greedy generation of ``prompts`` by a fresh engine; ``qkvfuse`` is the ``additional_config`` entry (None:
    no entry). ``inspect`` reads the fused layers off the model (in-process engines only); ``setup(model)`` runs
    in the engine before the generation and ``probe(model)`` after it (its result is ``Run.probed``);
    ``rounds``: the prompts generated that many times in turn by the one engine (a later round finds the earlier
    rounds' prompts in vLLM's prefix cache), the rounds' results one after the other in the ``Run``."""
    from vllm import LLM, SamplingParams

    additional = {} if qkvfuse is None else {"qkvfuse": qkvfuse}
    kwargs = dict(skip_tokenizer_init=True, enforce_eager=True, dtype=dtype, max_model_len=128,
                  max_num_batched_tokens=STEP_TOKENS, additional_config=additional, seed=0)
    kwargs.update(llm_kwargs)
    llm = LLM(model=model_dir, **kwargs)
    try:
        if setup is not None:
            llm.apply_model(setup)
        params = SamplingParams(temperature=0, max_tokens=new_tokens, detokenize=False, ignore_eos=True,
                                logprobs=2)
        outs = []
        for _ in range(rounds):
            outs += llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        logprobs, gaps = [], []
        for o in outs:
            steps = list(zip(o.outputs[0].logprobs, o.outputs[0].token_ids))
            logprobs.append([step[tok].logprob for step, tok in steps])
            gaps.append([step[tok].logprob - max(v.logprob for t, v in step.items() if t != tok)
                         for step, tok in steps])
        fused = llm.apply_model(fused_layers)[0] if inspect else None  # one entry per worker: rank 0
        probed = llm.apply_model(probe)[0] if probe is not None else None
    finally:
        del llm
        gc.collect()
    return Run(tokens, logprobs, gaps, fused, probed, [o.num_cached_tokens or 0 for o in outs])


def attention_layers(model: torch.nn.Module):
    """vLLM's ``Attention`` layers of ``model`` by layer name (run inside the engine)."""
    from vllm.model_executor.layers.attention.attention import Attention

    return {m.layer_name: m for m in model.modules() if isinstance(m, Attention)}


def zero_kv_caches(model: torch.nn.Module) -> None:
    """Zero every attention layer's KV cache (``generate``'s ``setup``: two engines' caches then differ only in
    what their steps wrote)."""
    for layer in attention_layers(model).values():
        layer.kv_cache.zero_()


def kv_caches(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """A copy of every attention layer's KV cache, ``{layer name: cache}`` (``generate``'s ``probe``)."""
    return {name: layer.kv_cache.clone() for name, layer in attention_layers(model).items()}


def assert_same_greedy(tokens, reference: Run, tie: float) -> None:
    """``tokens`` equal ``reference.tokens``, except that a sequence may part from the reference at a step where
    the reference's own choice was within ``tie`` of its runner-up (a near tie that rounding noise can flip;
    after it the sequences are no longer comparable)."""
    for k, (seq, ref, gaps) in enumerate(zip(tokens, reference.tokens, reference.gaps)):
        assert len(seq) == len(ref), (k, seq, ref)
        for i, (a, b) in enumerate(zip(seq, ref)):
            if a != b:
                assert gaps[i] <= tie, (f"prompt {k} step {i}: token {a} != {b} where the reference's margin "
                                        f"{gaps[i]:.4f} > {tie}", seq, ref)
                break


def fused_layers(model: torch.nn.Module) -> Dict[str, int]:
    """``{class name: layers whose forward qkvfuse replaced}`` (run inside the engine by ``apply_model``)."""
    counts: Dict[str, int] = {}
    for module in model.modules():
        if "_qkvfuse" in module.__dict__:
            counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    return counts


def hf_generate(model_dir: str, dtype: torch.dtype, prompts: Sequence[Sequence[int]] = PROMPTS,
                new_tokens: int = NEW_TOKENS) -> List[List[int]]:
    """transformers' greedy ``generate()`` of the same checkpoint, one prompt at a time."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([list(p)])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
            out.append(gen[0, len(p):].tolist())
    return out


def generate_with_edits(model_dir: str, dtype: str, qkvfuse: Optional[dict], edits: Sequence,
                        prompts: Sequence[Sequence[int]] = PROMPTS, new_tokens: int = NEW_TOKENS,
                        probe=None, **llm_kwargs) -> List[Tuple[Run, object]]:
    """One engine, greedy generation of ``prompts`` before and after each of ``edits`` (functions of the model,
    run inside the engine by ``llm.apply_model``, in order): ``[(Run, probe(model) or None)]``, one per
    generation. Prefix caching is off: a prompt seen before must be recomputed with the edited model."""
    from vllm import LLM, SamplingParams

    additional = {} if qkvfuse is None else {"qkvfuse": qkvfuse}
    kwargs = dict(skip_tokenizer_init=True, enforce_eager=True, dtype=dtype, max_model_len=128,
                  max_num_batched_tokens=STEP_TOKENS, additional_config=additional, seed=0,
                  enable_prefix_caching=False)
    kwargs.update(llm_kwargs)
    llm = LLM(model=model_dir, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, detokenize=False, ignore_eos=True, logprobs=2)
    runs = []
    try:
        for edit in (None, *edits):
            if edit is not None:
                llm.apply_model(edit)
            outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            logprobs, gaps = [], []
            for o in outs:
                steps = list(zip(o.outputs[0].logprobs, o.outputs[0].token_ids))
                logprobs.append([step[tok].logprob for step, tok in steps])
                gaps.append([step[tok].logprob - max(v.logprob for t, v in step.items() if t != tok)
                             for step, tok in steps])
            fused = llm.apply_model(fused_layers)[0]
            runs.append((Run(tokens, logprobs, gaps, fused), llm.apply_model(probe)[0] if probe else None))
    finally:
        del llm
        gc.collect()
    return runs
