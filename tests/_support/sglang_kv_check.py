"""Inside a test SGLang engine's scheduler: each KV-cache write of the SGLang plugin checked against SGLang's own
writer, on the same K and V (installed by ``sitecustomize.py`` when ``$QKVFUSE_TEST_KV_CHECK`` is set).

Around every fused write (:meth:`qkvfuse.integrations.sglang._KVWrite.write`) the pool's K/V buffers are copied
before the call and after it; then the buffers are put back as they were, SGLang's own writer runs on them as the
attention backend would call it (``token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(out_cache_loc), k, v)``,
with copies of the K and V views the fused op returned), and the two results are compared byte for byte: every
buffer and every row outside the written slots identical; the written rows identical for a pool of the
activations' dtype; for an FP8 pool, where the bytes differ, the fused op's value must be one that rounding some
value within half an activation-dtype ulp of SGLang's input gives (SGLang rounds the already-rounded activations
to FP8, qkvfuse rounds the fp32 result once: a near tie in between may go the other way; saturation to the
format's finite range where SGLang's cast gives inf). The pool is then left as the fused op wrote it.
"""

from __future__ import annotations

from typing import Callable, List

import torch


def _buffers(pool) -> List[torch.Tensor]:
    target = getattr(pool, "full_kv_pool", None) or pool
    return list(target.k_buffer) + list(target.v_buffer)


def _half_ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half a ``dtype`` ulp at each value of ``x`` (fp32): 0 for fp32 (the input is exact)."""
    if dtype == torch.float32:
        return torch.zeros_like(x)
    mantissa = {torch.bfloat16: 7, torch.float16: 10}[dtype]  # stored mantissa bits
    exponent = torch.floor(torch.log2(x.abs().clamp_min(torch.finfo(dtype).tiny)))
    return torch.exp2(exponent - mantissa - 1)


def _fp8_within_tie(got: torch.Tensor, source: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """Whether each FP8 value ``got`` is the rounding of some value within half an ulp of ``source`` (saturated)."""
    x = source.float()
    h = _half_ulp(x, source.dtype)
    big = torch.finfo(fp8).max
    lo = (x - h).to(fp8).float().nan_to_num(posinf=big, neginf=-big).clamp(-big, big)
    hi = (x + h).to(fp8).float().nan_to_num(posinf=big, neginf=-big).clamp(-big, big)
    g = got.float()
    return (g >= torch.minimum(lo, hi)) & (g <= torch.maximum(lo, hi))


def install(plugin, record: Callable[[str, int], None]) -> None:
    """Wrap ``plugin._KVWrite.write`` with the check; ``record(key, n)`` adds to the process's counts:
    ``kv_writes`` (checked calls), ``kv_rows`` (token rows written), ``kv_rows_differ`` (rows whose bytes differ
    from SGLang's), ``kv_bad`` (differences the rule above does not allow; must stay 0)."""
    original = plugin._KVWrite.write

    def checked_write(self, state, qkv, positions, forward_batch):
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc
        from sglang.srt.model_executor.forward_context import get_attn_backend

        backend = get_attn_backend()
        pool = backend.token_to_kv_pool
        before = [b.clone() for b in _buffers(pool)]
        out = original(self, state, qkv, positions, forward_batch)
        if out is None:
            return None
        ours = [b.clone() for b in _buffers(pool)]
        for buffer, saved in zip(_buffers(pool), before):
            buffer.copy_(saved)
        k, v = out[1], out[2]
        heads, dim = self.module.num_kv_heads, self.module.head_dim
        pool.set_kv_buffer(self.attn, KVWriteLoc(forward_batch.out_cache_loc, None),
                           k.reshape(-1, heads, dim).clone(), v.reshape(-1, heads, dim).clone())
        theirs = [b.clone() for b in _buffers(pool)]
        slots = forward_batch.out_cache_loc[: k.shape[0]].long()
        differ = bad = 0
        plan = self._plan
        half = len(ours) // 2
        for i, (a, b) in enumerate(zip(ours, theirs)):
            if torch.equal(a, b):
                continue
            outside = torch.ones(a.shape[0], dtype=torch.bool)
            outside[slots] = False
            bad += int((a[outside] != b[outside]).any())
            rows_a, rows_b = a[slots], b[slots]
            row_differs = (rows_a != rows_b).flatten(1).any(1)
            differ += int(row_differs.sum())
            if plan.fp8 is None:
                bad += int(row_differs.sum())
            else:
                source = (k if i < half else v).reshape(-1, heads, dim)
                ok = _fp8_within_tie(rows_a.view(plan.fp8), source, plan.fp8)
                bad += int((~ok).sum())
        for buffer, mine in zip(_buffers(pool), ours):
            buffer.copy_(mine)
        record("kv_writes", 1)
        record("kv_rows", int(slots.numel()))
        record("kv_rows_differ", differ)
        record("kv_bad", bad)
        return out

    plugin._KVWrite.write = checked_write

