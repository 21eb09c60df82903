"""The ``moe-streams`` device section: the shared-expert overlap on one GLM-4.7-sized MoE layer (CUDA).

``section(opts) -> Section`` runs, on ``opts.device`` (a CUDA device), in this order:

1. two sequential runs of the unpatched transformers block per T agree bit for bit (the baseline: without it,
   a later mismatch could not be blamed on streams);
2. eager and CUDA-graph timings, overlap off and on, at T = 1, 64, 512, and the shared expert alone; graph
   replays must equal the eager reference bit for bit (the overlap inside a captured graph); then where eager
   loses: ``torch.profiler`` over eager calls at the smallest T, overlap off and on -- host (self CPU) and device
   time per call, and the ops whose host time per call grew most with the overlap (informational rows);
3. the race check: 1 000 overlapped calls, T cycling through 1, 64, 512, with a ``torch.cuda._sleep`` in front
   of the shared expert on the side stream that is twice as long as the whole sequential layer, so a missing
   join would read the shared output before it is written; every output must equal the reference bitwise;
4. a control: the same with a helper that leaves out the join, which must show mismatches (proof that step 3
   can fail). Its count is reported; a control without mismatches marks the check insensitive, not failed.

Without CUDA (``--cpu-interpreter`` included) the section reports itself skipped; ``tests/moe`` runs the same
code on the host with a recording fake stream module (:class:`_HostApi`).
"""

from __future__ import annotations

import statistics
import time
import traceback
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from ..moe.glm4 import patch_glm4_moe, unpatch_glm4_moe
from ..moe.overlap import SharedExpertOverlap
from ..presets import ModelPreset, get_preset
from .sections import Options, Section

__all__ = ["section", "build_moe_block", "SECTION"]

SECTION = "moe-shared-expert-overlap"
TOKEN_COUNTS = (1, 64, 512)
RACE_ITERATIONS = 1000
CONTROL_ITERATIONS = 30
INPUTS_PER_T = 4
PROFILE_TOP = 5  # ops listed per profile row


def _profile(api, fn: Callable[[], object], reps: int) -> Dict[str, object]:
    """``torch.profiler`` over ``reps`` calls of ``fn`` (after one outside it): host time per call (the self CPU
    time of every recorded op), device time per call (CUDA runs), and ``{op: host us per call}``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if api.graphs else [])
    fn()
    api.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(reps):
            fn()
        api.synchronize()
    events = prof.key_averages()
    host = {e.key: e.self_cpu_time_total / reps for e in events}
    device = sum(getattr(e, "self_device_time_total", 0) for e in events) / reps
    return {"host_us": sum(host.values()), "device_us": device, "ops": host}


def _top(ops: Dict[str, float], n: int = PROFILE_TOP) -> str:
    return ", ".join(f"{name} {us:.1f}" for name, us in sorted(ops.items(), key=lambda kv: -kv[1])[:n])


def build_moe_block(preset: ModelPreset, device, dtype=torch.bfloat16, seed: int = 0) -> nn.Module:
    """A transformers ``Glm4MoeMoE`` with ``preset``'s MoE geometry and random weights, built on ``device``.

    Built on the meta device and materialised on ``device``, so a GLM-4.7 layer (7.5 GB of bf16 experts)
    never touches host memory. The experts use ``grouped_mm`` (the implementation a loaded model gets; no host
    synchronisation, so it can be captured in a CUDA graph); the correction bias stays fp32 as in checkpoints.
    """
    import transformers
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    config = transformers.Glm4MoeConfig(
        hidden_size=preset.hidden_size, moe_intermediate_size=preset.moe_intermediate_size,
        n_routed_experts=preset.num_experts, n_shared_experts=preset.num_shared_experts,
        num_experts_per_tok=preset.num_experts_per_tok, routed_scaling_factor=preset.routed_scaling_factor,
        n_group=1, topk_group=1, norm_topk_prob=True, experts_implementation="grouped_mm",
    )
    with torch.device("meta"):
        block = Glm4MoeMoE(config)
    block = block.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.02, generator=gen)
        block.gate.e_score_correction_bias = torch.empty(
            preset.num_experts, device=device, dtype=torch.float32).normal_(0.0, 0.05, generator=gen)
    return block.eval()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Device-side 0/1: whether any element differs in its bits (NaN never equals anything here either)."""
    return (_bits(a) != _bits(b)).any().to(torch.int64)


class _CudaApi:
    """The few device calls the check makes; :class:`_HostApi` stands in for it in the CPU smoke test."""

    graphs = True

    def __init__(self, device: torch.device):
        self.device = device

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def sleep(self, cycles: int) -> None:
        torch.cuda._sleep(int(cycles))

    def time_ms(self, fn: Callable[[], object], reps: int, trials: int = 3) -> float:
        fn()
        self.synchronize()
        means = []
        for _ in range(trials):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            means.append(start.elapsed_time(end) / reps)
        return statistics.median(means)

    def sleep_cycles_per_ms(self) -> float:
        cycles = 20_000_000
        return cycles / self.time_ms(lambda: self.sleep(cycles), reps=1)

    def capture(self, fn: Callable[[], torch.Tensor]):
        # Warm up on a side stream first (cuBLAS handles and workspaces of every stream the capture touches
        # must exist before capture), as the torch.cuda.graph documentation prescribes.
        warm = torch.cuda.Stream(self.device)
        warm.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(warm):
            for _ in range(3):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(warm)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        return graph.replay, out


class _HostApi:
    graphs = False

    def __init__(self, device: torch.device):
        self.device = device

    def synchronize(self) -> None:
        pass

    def sleep(self, cycles: int) -> None:
        pass

    def time_ms(self, fn, reps: int, trials: int = 3) -> float:
        fn()
        means = []
        for _ in range(trials):
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            means.append((time.perf_counter() - start) * 1e3 / reps)
        return statistics.median(means)

    def sleep_cycles_per_ms(self) -> float:
        return 1.0

    def capture(self, fn):
        raise NotImplementedError


class _WithoutJoin(SharedExpertOverlap):
    """The classic bug, for the control only: the shared output is read without waiting for the side stream."""

    def run(self, hidden, shared_fn, routed_fn, combine=torch.add):
        module = self.stream_module(hidden.device)
        if module is None:
            return super().run(hidden, shared_fn, routed_fn, combine)
        side = self.side_stream(hidden.device, module)
        side.wait_stream(module.current_stream(hidden.device))
        with module.stream(side):
            shared = shared_fn(hidden)
        return combine(routed_fn(hidden), shared)


def _run(api, block: nn.Module, preset: ModelPreset, quick: bool, runner: SharedExpertOverlap,
         token_counts=TOKEN_COUNTS, race_iterations: int = RACE_ITERATIONS, reps: Optional[int] = None,
         control_iterations: int = CONTROL_ITERATIONS) -> Dict[str, object]:
    device, dtype = api.device, next(block.parameters()).dtype
    reps = reps or (20 if quick else 100)
    errors: List[str] = []
    gen = torch.Generator(device=device).manual_seed(1)
    xs = {T: [torch.randn(1, T, preset.hidden_size, device=device, dtype=dtype, generator=gen)
              for _ in range(INPUTS_PER_T)] for T in token_counts}

    def guarded(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # one failing stage must not hide the results of the others
            errors.append(f"{name}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}")

    rows = {T: {"T": T} for T in token_counts}
    refs: Dict[int, List[torch.Tensor]] = {}
    # The delay in front of the shared expert, per T: twice the whole sequential layer (set in race()).
    sleep_cycles = {T: 0 for T in token_counts}
    race = {"iterations": race_iterations, "mismatches": None, "control_iterations": control_iterations,
            "control_mismatches": None, "sleep_us": {}}

    def baseline():  # 1. the sequential baseline, repeated
        unpatch_glm4_moe(block)
        for T in token_counts:
            refs[T] = [block(x) for x in xs[T]]
            again = torch.stack([_differs(block(x), r) for x, r in zip(xs[T], refs[T])]).sum()
            rows[T]["seq_repeat_equal"] = int(again) == 0

    def eager_timing():  # 2a.
        for T in token_counts:
            x = xs[T][0]
            for label, overlap in (("off", False), ("on", True)):
                patch_glm4_moe(block, overlap=overlap, runner=runner)
                rows[T][f"eager_{label}_us"] = 1e3 * api.time_ms(lambda: block(x), reps)

    profiles: Dict[str, Dict[str, object]] = {}

    def eager_profile():  # 2c. where eager loses, at the smallest T
        x = xs[token_counts[0]][0]
        for label, overlap in (("off", False), ("on", True)):
            patch_glm4_moe(block, overlap=overlap, runner=runner)
            profiles[label] = _profile(api, lambda: block(x), reps)

    def graph_timing(T: int, label: str, overlap: bool):  # 2b. one captured variant, replay checked bitwise
        x = xs[T][0]
        if label == "shared":
            replay, _ = api.capture(lambda: block.shared_experts(x))
            rows[T]["shared_alone_us"] = 1e3 * api.time_ms(replay, reps)
            return
        patch_glm4_moe(block, overlap=overlap, runner=runner)
        replay, out = api.capture(lambda: block(x))
        rows[T][f"graph_{label}_us"] = 1e3 * api.time_ms(replay, reps)
        replay()
        rows[T][f"graph_{label}_equal"] = int(_differs(out, refs[T][0])) == 0

    def delayed(helper: SharedExpertOverlap, iterations: int) -> int:
        current = {"T": token_counts[0]}
        # A pre-hook of the shared expert runs inside the side-stream context: the sleep lands on the side stream.
        hook = block.shared_experts.register_forward_pre_hook(
            lambda module, args: api.sleep(sleep_cycles[current["T"]]))
        patch_glm4_moe(block, overlap=True, runner=helper)
        bad = torch.zeros((), dtype=torch.int64, device=device)
        try:
            for i in range(iterations):
                T = token_counts[i % len(token_counts)]
                j = (i // len(token_counts)) % INPUTS_PER_T
                current["T"] = T
                bad += _differs(block(xs[T][j]), refs[T][j])
            api.synchronize()
        finally:
            hook.remove()
        return int(bad)

    def race_check():  # 3.
        per_ms = api.sleep_cycles_per_ms()
        patch_glm4_moe(block, overlap=False)
        for T in token_counts:
            layer_ms = api.time_ms(lambda: block(xs[T][0]), reps=5, trials=1)
            sleep_cycles[T] = int(2 * layer_ms * per_ms)
            race["sleep_us"][str(T)] = 2e3 * layer_ms
        race["mismatches"] = delayed(runner, race_iterations)

    def control():  # 4. without the join the same check must see mismatches
        race["control_mismatches"] = delayed(_WithoutJoin(enabled=True), control_iterations)

    with torch.inference_mode():
        baseline()
        guarded("eager timing", eager_timing)
        if api.graphs:
            for T in token_counts:
                for label, overlap in (("off", False), ("on", True), ("shared", False)):
                    guarded(f"graph {label} T={T}", lambda: graph_timing(T, label, overlap))
        guarded("eager profile", eager_profile)
        for mode in ("eager", "graph"):
            for r in rows.values():
                off, on = r.get(f"{mode}_off_us"), r.get(f"{mode}_on_us")
                r[f"{mode}_speedup"] = off / on if off and on else None
        guarded("race", race_check)
        guarded("control", control)
        unpatch_glm4_moe(block)

    row_list = [rows[T] for T in token_counts]
    for r in row_list:
        r["check"] = "layer"
        r["pass"] = r.get("seq_repeat_equal", False) and all(r.get(f"graph_{m}_equal", True) for m in ("off", "on"))
    sensitive = bool(race["control_mismatches"])
    ts = ", ".join(str(T) for T in token_counts)
    row_list.append({"check": "race (join present)", "T": ts, "pass": race["mismatches"] == 0,
                     "detail": f"{race['mismatches']} / {race_iterations} mismatching"})
    row_list.append({"check": "control (join left out)", "T": ts, "pass": True,  # informational, see the docstring
                     "detail": f"{race['control_mismatches']} / {control_iterations} mismatching"
                     + ("" if sensitive else " (insensitive)")})
    for label, prof in profiles.items():  # informational: where the time of an eager call goes
        row_list.append({"check": f"eager profile, overlap {label}", "T": token_counts[0], "pass": True,
                         "detail": f"host {prof['host_us']:.1f} us/call, device {prof['device_us']:.1f} us/call; "
                                   f"largest host ops (us/call): {_top(prof['ops'])}"})
    if len(profiles) == 2:
        off, on = profiles["off"]["ops"], profiles["on"]["ops"]
        grown = {name: on.get(name, 0.0) - off.get(name, 0.0) for name in set(off) | set(on)}
        row_list.append({"check": "eager profile, on - off", "T": token_counts[0], "pass": True,
                         "detail": f"host {profiles['on']['host_us'] - profiles['off']['host_us']:+.1f} us/call; "
                                   f"grown most (us/call): {_top({k: v for k, v in grown.items() if v > 0})}"})
    row_list += [{"check": "error", "pass": False, "detail": e.splitlines()[0], "traceback": e} for e in errors]
    columns = ("check", "T", "eager_off_us", "eager_on_us", "eager_speedup", "graph_off_us", "graph_on_us",
               "graph_speedup", "shared_alone_us", "seq_repeat_equal", "graph_off_equal", "graph_on_equal", "detail",
               "pass")
    delays = ", ".join(f"T={t}: {v:.0f} us" for t, v in race["sleep_us"].items())
    note = (f"{dtype}, grouped_mm experts; race: {race_iterations} overlapped calls with a side-stream delay of 2x "
            f"the layer ({delays or 'not measured'}); the control leaves out the join and should mismatch"
            + ("" if sensitive else " -- here it did not: the race check is insensitive on this device"))
    title = (f"{SECTION}: {preset.name} MoE layer ({preset.num_experts} experts, top-{preset.num_experts_per_tok}, "
             f"expert {preset.moe_intermediate_size}, shared x{preset.num_shared_experts})")
    return Section(title, columns, row_list, note)


def section(opts: Options, preset: Optional[ModelPreset] = None) -> Section:
    """Run the overlap device check on ``opts.device`` (CUDA only); see the module docstring."""
    preset = preset or get_preset("GLM-4.7")
    device = opts.torch_device
    if device.type != "cuda" or not torch.cuda.is_available():
        reason = (f"needs a CUDA device, this run is on {device}" if device.type != "cuda" else "no CUDA device")
        return Section(SECTION, ("check", "pass"), [], note=f"skipped: {reason} (the overlap runs inline on CPU; "
                                                            "tests/moe covers its stream protocol there)")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    block = None
    try:
        block = build_moe_block(preset, device)
        return _run(_CudaApi(device), block, preset, opts.quick, SharedExpertOverlap(enabled=True))
    except Exception as exc:  # a device run is precious: report, do not take the other sections down
        error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
        return Section(SECTION, ("check", "pass", "detail"), [{"check": "error", "pass": False,
                                                               "detail": error.splitlines()[0], "traceback": error}])
    finally:
        del block
        torch.cuda.empty_cache()
