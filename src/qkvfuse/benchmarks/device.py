"""``python -m qkvfuse bench --device cuda``: the Triton backend's timings on an accelerator.

* :func:`timing_section` -- both ops per preset and T: the Triton launcher, the eager reference and
  ``torch.compile(reference, dynamic=True)`` on the same preallocated outputs, bytes moved, and the fraction of a
  same-size tensor copy's bandwidth (target >= 80 % for T >= 4096);
* :func:`tile_sweep_section` -- full tier or ``--tile-sweep``: time per device tile size and elements per thread
  (``launch.GPU_SPLIT_TILE``, ``launch.GPU_SPLIT_PER_THREAD``), to tune them.

Sizes by tier as for the device sections of ``verify`` (:mod:`qkvfuse._verify.device`): ``--quick``, the full
default, and ``--cpu-interpreter`` (small sizes on CPU under ``TRITON_INTERPRET=1``: wall-clock medians of the
interpreter, a dry run of the code, not a measurement). Correctness on the device is ``verify --device cuda``.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
import traceback
from typing import Optional, Sequence

import torch

from .._library import split_config
from .._verify.device import launch_direct, poisoned_outputs, row, split_case, synchronize
from .._verify.inputs import make_norm_inputs, make_split_inputs
from .._verify.sections import Options, Section, header, print_section, triton_interpreter
from ..presets import PRESETS, get_preset

__all__ = ["TIERS", "timing_section", "tile_sweep_section", "run_device_bench"]

TIERS = {  # presets (None: every preset) and token counts of the timing table
    "cpu": dict(presets=("Qwen3-8B",), tokens=(5,)),
    "quick": dict(presets=("Qwen3-8B", "GLM-4.7"), tokens=(1, 16, 256, 4096, 16384)),
    "full": dict(presets=None, tokens=(1, 16, 256, 1024, 4096, 16384)),
}
BANDWIDTH_TARGET = 0.8


def _clocks_up(device: torch.device, ms: float = 50.0) -> None:
    """Keep the device busy for ``ms`` before a timing: an idle GPU drops its clocks (an H200 reads 345 MHz idle,
    1980 MHz busy), and do_bench's own 25 ms warm-up is too short to bring them back after a compile."""
    a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < ms:
        for _ in range(8):
            a @ a
        synchronize(device)


def _timer(device: torch.device):
    """Median milliseconds of ``fn()``: triton.testing.do_bench on a device (after :func:`_clocks_up`), a wall
    clock on CPU."""
    if device.type != "cpu":
        import triton.testing

        def on_device(fn):
            _clocks_up(device)
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

        return on_device

    def wall(fn, repeats=3):
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return wall


def _split_bytes(case) -> int:
    """Bytes the op must move: qkv read, q/k/v written, positions read, one cos/sin value per rotary lane."""
    e = torch.tensor([], dtype=case.dtype).element_size()
    positions = case.T * (3 if case.mrope_section else 1) * 8
    return 2 * case.T * case.width * e + positions + case.T * case.rotary_dim * 4


def timing_section(opts: Options, presets: Optional[Sequence[str]] = None,
                   tokens: Optional[Sequence[int]] = None) -> Section:
    """Triton vs the eager and compiled reference, bf16, per preset and T (defaults: the tier's)."""
    from .. import reference
    from ..backends.triton import launch

    device, rows = opts.torch_device, []
    tier = TIERS[opts.tier]
    presets = presets or tier["presets"] or tuple(PRESETS)
    tokens = tokens or tier["tokens"]
    bench = _timer(device)
    compiled = {}

    def measure(op, label, T, triton_fn, reference_fn, call, nbytes, copy_src):
        """One row: the Triton launcher, the eager and compiled reference on the same preallocated outputs."""
        try:
            ms_triton = bench(lambda: triton_fn(*call))
            ms_eager = bench(lambda: reference_fn(*call))
            ms_compiled = float("nan")
            if device.type != "cpu":  # one dynamic-shape compile per (op, geometry), as serving engines compile
                fn = compiled.setdefault((op, label), torch.compile(reference_fn, dynamic=True))
                ms_compiled = bench(lambda: fn(*call))
            dst = torch.empty_like(copy_src)
            ms_copy = bench(lambda: dst.copy_(copy_src))
            copy_gbs = 2 * copy_src.numel() * copy_src.element_size() / ms_copy / 1e6
            fraction = nbytes / ms_triton / 1e6 / copy_gbs
            target = ("met" if fraction >= BANDWIDTH_TARGET else "below") if T >= 4096 else "-"
            rows.append(row(op=op, shape=label, T=T, **{
                "triton us": ms_triton * 1e3, "eager us": ms_eager * 1e3, "compile us": ms_compiled * 1e3,
                "vs compile": ms_compiled / ms_triton, "GB/s": nbytes / ms_triton / 1e6, "copy GB/s": copy_gbs,
                "of copy": fraction, "target": target}))
        except Exception as exc:
            rows.append(row(op=op, shape=label, T=T, **{"pass": False, "detail": f"{type(exc).__name__}: {exc}"}))

    for preset_name in presets:
        for T in tokens:
            case = split_case(preset_name, T, torch.bfloat16)
            kwargs = make_split_inputs(case, seed=T, device=device)
            call = (kwargs["qkv"], kwargs["positions"], split_config(**kwargs), *poisoned_outputs(case, device),
                    *(() if case.q_gate else (None,)))  # gated: 4 outputs
            measure("split_qkv_rmsnorm_rope", preset_name, T, launch.split_qkv_rmsnorm_rope_out,
                    reference.split_qkv_rmsnorm_rope_out, call, _split_bytes(case), kwargs["qkv"])
            del kwargs, call
        hidden = get_preset(preset_name).hidden_size
        for T in tokens:
            kw = make_norm_inputs(T, hidden, torch.bfloat16, residual=True, device=device)
            x = kw["x"]
            call = (x, kw["residual"], kw["weight"], None, kw["eps"], False, torch.empty_like(x), torch.empty_like(x))
            measure("add_rmsnorm", f"{preset_name} ({hidden})", T, launch.add_rmsnorm_out, reference.add_rmsnorm_out,
                    call, 4 * x.numel() * x.element_size(), x)
    note = ("median of triton.testing.do_bench (ms -> us) on preallocated outputs; bytes = qkv read + q/k/v written "
            "+ positions + cos/sin (add_rmsnorm: x, residual read, y, residual_out written); 'of copy' = op GB/s / "
            f"GB/s of a same-size tensor copy; target >= {BANDWIDTH_TARGET:.0%} for T >= 4096; compile = "
            "torch.compile(reference, dynamic=True)")
    if device.type == "cpu":
        note = "cpu-interpreter mode: wall-clock medians of the interpreter, not kernel timings; " + note
    return Section("timing (bf16)", ("op", "shape", "T", "triton us", "eager us", "compile us", "vs compile", "GB/s",
                                     "copy GB/s", "of copy", "target"), rows, note)


# The tile sweep's grid: on a device, and under the CPU interpreter (a dry run: there the launcher ignores the
# device tiles, so the rows time one configuration; the code path is what it checks).
SWEEP = {"device": dict(presets=("Qwen3-8B", "GLM-4.7"), tokens=(1, 16, 4096, 16384), tiles=(1024, 2048, 4096, 8192),
                        per_thread=(4, 8, 16, 32)),
         "cpu": dict(presets=("Qwen3-8B",), tokens=(5,), tiles=(1024, 2048), per_thread=(32,))}


def tile_sweep_section(opts: Options, force: bool = False) -> Optional[Section]:
    """Full tier or ``force`` (``--tile-sweep``) only, else None: the split kernel's time per device tile size
    (``launch.GPU_SPLIT_TILE``) and elements per thread (``launch.GPU_SPLIT_PER_THREAD``: the number of warps),
    over :data:`SWEEP`, to tune their defaults."""
    from ..backends.triton import launch

    if opts.tier != "full" and not force:
        return None
    rows = []
    device = opts.torch_device
    grid = SWEEP["cpu" if device.type == "cpu" else "device"]
    bench, default = _timer(device), (launch.GPU_SPLIT_TILE, launch.GPU_SPLIT_PER_THREAD)
    try:
        for preset_name in grid["presets"]:
            for T in grid["tokens"]:
                case = split_case(preset_name, T, torch.bfloat16)
                kwargs = make_split_inputs(case, seed=T, device=device)
                out = poisoned_outputs(case, device)
                for tile in grid["tiles"]:
                    for per_thread in grid["per_thread"]:
                        launch.GPU_SPLIT_TILE, launch.GPU_SPLIT_PER_THREAD = tile, per_thread
                        ms = bench(lambda: launch_direct(kwargs, out))
                        rows.append(row(preset=preset_name, T=T, tile=tile, per_thread=per_thread,
                                        warps=launch._num_warps(tile, per_thread), us=ms * 1e3,
                                        **{"GB/s": _split_bytes(case) / ms / 1e6}))
    finally:
        launch.GPU_SPLIT_TILE, launch.GPU_SPLIT_PER_THREAD = default
    return Section("tile sweep (launch.GPU_SPLIT_TILE x GPU_SPLIT_PER_THREAD)",
                   ("preset", "T", "tile", "per_thread", "warps", "us", "GB/s"), rows,
                   f"defaults GPU_SPLIT_TILE = {default[0]}, GPU_SPLIT_PER_THREAD = {default[1]}")


def run_device_bench(args) -> int:
    """``bench --device <accelerator>`` / ``bench --cpu-interpreter``: print the tables; 1 if a row failed."""
    opts = Options(quick=args.quick, device=args.device, cpu_interpreter=args.cpu_interpreter)
    reason = triton_interpreter() if opts.cpu_interpreter else ""
    if reason:
        print(f"bench: --cpu-interpreter: {reason}")
        return 2
    from ..backends import backend_unavailable

    try:
        presets = tuple(get_preset(name).name for name in args.preset or ())
    except KeyError as exc:
        print(f"bench: {exc.args[0] if exc.args else exc}")
        return 2
    info = header(opts)
    print(json.dumps(info))
    reason = backend_unavailable("triton")
    if reason:
        print(f"bench: triton backend unavailable: {reason}")
        return 1
    result = dict(info, sections=[])
    failures, start = 0, time.perf_counter()
    for name, make in (("timing", lambda: timing_section(opts, presets, args.tokens)),
                       ("tile-sweep", lambda: tile_sweep_section(opts, getattr(args, "tile_sweep", False)))):
        t0 = time.perf_counter()
        try:
            section = make()
            synchronize(opts.torch_device)
        except Exception as exc:  # report, keep the other section's results
            traceback.print_exc()
            section = Section(name, ("check", "pass"), [{"check": name, "pass": False,
                                                         "detail": f"{type(exc).__name__}: {exc}"}])
        if section is None:
            continue
        print_section(section)
        failures += section.failures
        result["sections"].append(dict(dataclasses.asdict(section), name=name,
                                       seconds=round(time.perf_counter() - t0, 1)))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=1, default=str)
    print(f"\nbench ({opts.tier}, {info['device']}): {failures} failed rows in {time.perf_counter() - start:.0f} s"
          + (f"; JSON: {args.json}" if args.json else ""))
    return 1 if failures else 0
