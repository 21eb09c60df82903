"""Timing primitives: interleaved rounds of candidate blocks and copy-roofline blocks, and the machine line.

A *block* is ``n`` back-to-back calls timed with one ``perf_counter_ns`` pair (so the timer costs nothing per
call); its value is the mean per call. Every candidate block is immediately preceded by a block of the
roofline copy over the same buffers, so each candidate gets a copy time measured seconds, not minutes, from its
own: on a shared machine the copy alone moved 43 and 62 GB/s minutes apart. Ratios (fraction of roofline,
speedups) are medians of per-round ratios, never ratios of medians taken at different times.

Calls are zero-argument callables, one per buffer set. Cycling over several buffer sets (``len(calls) > 1``)
evicts them from L2 between visits; a single set stays in L1/L2 for the small token counts.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import platform
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["Candidate", "Measured", "Budget", "measure", "paired", "machine_info", "cache_bytes", "cpu_snapshot",
           "others_share", "fixed_point_weights", "restorer"]

Call = Callable[[], object]


def fixed_point_weights(weight: Optional[torch.Tensor], gemma: bool = False) -> Optional[torch.Tensor]:
    """A QK-norm weight for timing an in-place split on one buffer again and again: ones (Gemma: zeros, i.e.
    ``1 + w = 1``) of ``weight``'s shape and dtype, so each call's output is a fixed point of the next call's
    normalisation. With other weights every call multiplies element ``i`` by ``w_i`` once more: after hundreds of
    calls the small ones are denormals, which Intel cores process far slower (measured on the Xeon VM: a T=16
    Qwen3-Next in-place call went from 87 to 590 us over 1 200 calls) and which send the AVX512-BF16 rounding to
    its exact fallback -- a benchmark artefact, never a user's input. Even at a fixed point the rotation's
    rounding lets the elements' shares of a head drift (Zen 4, Qwen3-8B heads at T = 64 in place: the smallest
    |value| 9e-6 at first, 2e-25 after 10 000 calls, a bf16 denormal after 20 000), so the in-place candidates
    also restore their buffers before each timed block (:class:`Candidate`'s ``reset``, :func:`restorer`)."""
    if weight is None:
        return None
    return torch.zeros_like(weight) if gemma else torch.ones_like(weight)


@dataclasses.dataclass
class Candidate:
    """One implementation under test: ``impl`` (what runs) and ``outputs`` (``"out="`` or ``"fresh"``). A
    candidate that rewrites its own inputs (the in-place forms) carries ``reset``, called untimed before its warm-up
    and before each of its blocks: the inputs it restores see at most one block's calls (:func:`fixed_point_weights`
    says why that matters)."""

    impl: str
    outputs: str
    calls: Sequence[Call]
    reset: Optional[Call] = None

    @property
    def key(self) -> str:
        return f"{self.impl} [{self.outputs}]"


@dataclasses.dataclass
class Measured:
    """Per-call medians of one candidate over the rounds, and its medians of per-round ratios."""

    us: float
    copy_us: float  # median of the copy blocks run just before this candidate's blocks
    roofline: float  # median over rounds of copy_us / us
    vs: Dict[str, float]  # other candidate key -> median over rounds of other_us / us (> 1: this one is faster)
    rounds: int
    calls_per_block: int
    samples: List[float] = dataclasses.field(default_factory=list)  # per-round us, in round order
    copy_samples: List[float] = dataclasses.field(default_factory=list)  # the copy block timed before each


def paired(a: Measured, b: Measured, fn: Callable[[float, float], float]) -> float:
    """Median over rounds of ``fn(a's time, b's time)`` for two candidates of one :func:`measure` call (their
    blocks of round r ran seconds apart), e.g. ``lambda x, y: x - y`` or ``lambda x, y: x / y``."""
    return statistics.median(fn(x, y) for x, y in zip(a.samples, b.samples))


@dataclasses.dataclass(frozen=True)
class Budget:
    """How long to measure: ``block_s`` per timed block, about ``cell_s`` per measurement, 3+ rounds."""

    block_s: float = 2e-3
    cell_s: float = 4.0
    warm_s: float = 0.05
    min_rounds: int = 3
    max_rounds: int = 25


def restorer(buffers: Sequence[torch.Tensor]) -> Call:
    """A :class:`Candidate` ``reset``: copies each of ``buffers``' current contents back into it when called."""
    saved = [(b, b.clone()) for b in buffers]

    def reset():
        for b, original in saved:
            b.copy_(original)
    return reset


def _schedule(calls: Sequence[Call], n: int) -> List[Call]:
    return [calls[i % len(calls)] for i in range(n)]


def _block_us(schedule: Sequence[Call]) -> float:
    t0 = time.perf_counter_ns()
    for call in schedule:
        call()
    return (time.perf_counter_ns() - t0) / len(schedule) / 1e3


def _estimate_us(calls: Sequence[Call], warm_s: float) -> float:
    """Warm up (one pass over every buffer set first: lazy init, first-touch page faults) and estimate."""
    t0 = time.perf_counter()
    for call in calls:
        call()
    first = (time.perf_counter() - t0) / len(calls)
    if first * len(calls) >= warm_s:
        return first * 1e6  # a slow call (seconds at T = 4096 for eager paths): do not pay for it again
    n, t0 = 0, time.perf_counter()
    while n < len(calls) or time.perf_counter() - t0 < warm_s:
        calls[n % len(calls)]()
        n += 1
    return (time.perf_counter() - t0) / n * 1e6


def measure(candidates: Sequence[Candidate], copy_calls: Sequence[Call], budget: Budget) -> Dict[str, Measured]:
    """Time every candidate and the roofline copy in interleaved rounds; results keyed by ``Candidate.key``.

    Each block makes at least one full pass over the buffer sets, so a rotated block really rotates. The round
    order shifts by one candidate per round, so no candidate always runs right after the same neighbour.
    """
    def reset(c: Candidate):
        if c.reset is not None:
            c.reset()

    est = {}
    for c in candidates:
        reset(c)
        est[c.key] = _estimate_us(c.calls, budget.warm_s)
    copy_est = _estimate_us(copy_calls, budget.warm_s)

    def calls_for(us: float, n_buffers: int) -> int:
        return max(n_buffers, math.ceil(budget.block_s * 1e6 / max(us, 1e-3)))

    sched = {c.key: _schedule(c.calls, calls_for(est[c.key], len(c.calls))) for c in candidates}
    copy_sched = _schedule(copy_calls, calls_for(copy_est, len(copy_calls)))
    round_us = sum(len(sched[c.key]) * est[c.key] + len(copy_sched) * copy_est for c in candidates)
    rounds = min(budget.max_rounds, max(budget.min_rounds, int(budget.cell_s * 1e6 / max(round_us, 1.0))))

    times: Dict[str, List[float]] = {c.key: [] for c in candidates}
    copies: Dict[str, List[float]] = {c.key: [] for c in candidates}
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection inside a 5 us block would be charged to whichever candidate triggered it
    try:
        for r in range(rounds):
            shift = r % len(candidates)
            for c in list(candidates[shift:]) + list(candidates[:shift]):
                reset(c)  # before the copy block, which evicts what the reset brought into the caches
                copies[c.key].append(_block_us(copy_sched))
                times[c.key].append(_block_us(sched[c.key]))
    finally:
        if gc_was_enabled:
            gc.enable()

    results = {}
    for c in candidates:
        mine = times[c.key]
        results[c.key] = Measured(
            us=statistics.median(mine),
            copy_us=statistics.median(copies[c.key]),
            roofline=statistics.median(cp / t for cp, t in zip(copies[c.key], mine)),
            vs={o.key: statistics.median(ot / t for ot, t in zip(times[o.key], mine))
                for o in candidates if o.key != c.key},
            rounds=rounds,
            calls_per_block=len(sched[c.key]),
            samples=mine,
            copy_samples=copies[c.key],
        )
    return results


def cache_bytes(level: int, default: int) -> int:
    """Size of CPU 0's unified/data cache at ``level`` from sysfs (``default`` where sysfs does not say)."""
    root = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in sorted(os.listdir(root)):
            path = os.path.join(root, index)
            with open(os.path.join(path, "level")) as fh:
                if int(fh.read()) != level:
                    continue
            with open(os.path.join(path, "type")) as fh:
                if fh.read().strip() == "Instruction":
                    continue
            with open(os.path.join(path, "size")) as fh:
                text = fh.read().strip()
            units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
            return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
    except (OSError, ValueError):
        pass
    return default


def _cpuinfo() -> Dict[str, str]:
    info: Dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "flags") and key not in info:
                    info[key] = value.strip()
    except OSError:
        pass
    return info


def machine_info() -> Dict[str, object]:
    """What the numbers depend on: CPU model and SIMD flags, cores, torch threads, caches, allocator, load."""
    cpu = _cpuinfo()
    flags = set(cpu.get("flags", "").split())
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return {
        "cpu": cpu.get("model name") or platform.processor() or platform.machine(),
        "simd": simd,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "l2_bytes": cache_bytes(2, 0),
        "l3_bytes": cache_bytes(3, 0),
        # glibc tunables that change the fresh-output numbers (mmap per >= 32 MB allocation by default)
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k.startswith("GLIBC_TUN")},
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def cpu_snapshot() -> Optional[Tuple[float, float, float]]:
    """``(busy seconds of all CPUs, busy seconds of this process, wall seconds)`` or None without ``/proc``."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
        with open("/proc/self/stat") as fh:
            own = fh.read().rsplit(")", 1)[1].split()  # the command name may contain spaces
    except (OSError, ValueError, IndexError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    # user nice system idle iowait irq softirq steal: steal is time the hypervisor gave to other guests
    busy = sum(fields[i] for i in (0, 1, 2, 5, 6, 7) if i < len(fields))
    return busy / tick, (int(own[11]) + int(own[12])) / tick, time.monotonic()


def others_share(before, after) -> Optional[float]:
    """Fraction of the machine's CPU time used by other processes (and other guests) between two snapshots."""
    if before is None or after is None or after[2] <= before[2]:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others / ((after[2] - before[2]) * (os.cpu_count() or 1)))
