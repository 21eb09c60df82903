"""Raw ops at int64 edge values: every integer argument of every op, on every namespace.

A loaded ``torch.export`` program calls ``torch.ops.qkvfuse*`` directly, with whatever ints it holds. Each call here
sets one integer argument (or both head counts) of a small valid call to an int64 edge value -- 0, -1, 2**31 - 1,
2**31, 2**31 + 1, 2**62 + 1, 2**63 - 1 -- and must either be refused with the exception type and message the
reference gives for the same call, or run and agree with the reference. Head counts are where the native
arithmetic would wrap (``(2 Hq + 2 Hkv) * D`` of ``Hq = Hkv = 2**62 + 1`` is 4 * D), so the issue's own calls are
here too, with tensors shaped for the wrapped sizes. The public functions take the same head counts: their
refusal must be the raw op's, word for word.

``python -m qkvfuse._verify.int_edges BACKEND`` runs them for one backend (``cpu`` adds the native library's own
``qkvfuse_cpu`` ops), one JSON line per call with a ``start`` line first, so a crash names the call it died in
(``tests/test_validation.py`` runs it in a child process). Tensors are tiny: the Triton interpreter runs the
calls that are accepted.
"""

from __future__ import annotations

import json
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import _library
from .._checks import MAX_HEADS
from ..backends import select_ops

__all__ = ["EDGES", "HEAD_EDGES", "SWEPT", "cases", "run"]

EDGES = (0, -1, 2**31 - 1, 2**31, 2**31 + 1, 2**62 + 1, 2**63 - 1)
# Head counts also at the bound and one past it: the native copy of the bound is the Python one, or the messages
# differ.
HEAD_EDGES = EDGES + (MAX_HEADS, MAX_HEADS + 1)

# Every integer argument of every op, as "namespace::op.argument"; the test holds this to the registered schemas.
_SPLIT_INTS = ("num_q_heads", "num_kv_heads", "rope")
_SPLIT_OPS = ("split_qkv_rmsnorm_rope", "split_qkv_rmsnorm_rope_out", "split_qkv_rmsnorm_rope_inplace",
              *_library.CACHE_OPS)
SWEPT = frozenset(
    [f"{ns}::{op}.{arg}" for ns in _library.NAMESPACES.values() for op in _SPLIT_OPS for arg in _SPLIT_INTS]
    + [f"{ns}::{op}.cache_mode" for ns in _library.NAMESPACES.values() for op in _library.CACHE_OPS]
    + [f"qkvfuse_cpu::split_generic_out.{arg}" for arg in _SPLIT_INTS]
    + ["qkvfuse_cpu::mrope_axis_map.half", "qkvfuse_cpu::mrope_axis_map.mrope_section",
       "qkvfuse_cpu::decode_rope.rope", "qkvfuse_cpu::grain_items.elems_per_item"])

T, D, R = 2, 8, 4  # tokens, head_dim, rotary_dim of the base calls
_FORMS = {"functional": "split_qkv_rmsnorm_rope", "out": "split_qkv_rmsnorm_rope_out",
          "inplace": "split_qkv_rmsnorm_rope_inplace", "cache": "split_qkv_rmsnorm_rope_cache",
          "cache_out": "split_qkv_rmsnorm_rope_cache_out"}
BLOCKS, BLOCK_SIZE = 2, 4  # the cache form's NHD caches: [BLOCKS, BLOCK_SIZE, 1 KV head, D], fp32

Outcome = Tuple[str, object]  # ("raised", "Type: message") or ("ran", tensors to compare)


def _split_args(hq: int, hkv: int, rope: int, gated: bool, width: Optional[int] = None,
                out_widths: Optional[Sequence[int]] = None, norm: bool = True, tokens: int = T):
    """Fresh ``(args, outs)`` of a split call: qkv ``[tokens, width]`` (default: the base geometry's width),
    fp32, fixed values; ``outs`` the out= form's outputs (default widths: the base geometry's)."""
    base_hq, base_hkv = 2, 1
    g = torch.Generator().manual_seed(0)
    width = width or ((2 if gated else 1) * base_hq + 2 * base_hkv) * D
    qkv = torch.randn(tokens, width, generator=g)
    positions = torch.arange(tokens, dtype=torch.int64) % 7
    cache = torch.randn(8, R, generator=g)
    w = (torch.randn(D, generator=g), torch.randn(D, generator=g)) if norm else (None, None)
    if out_widths is None:
        out_widths = (base_hq * D, base_hkv * D, base_hkv * D) + ((base_hq * D,) if gated else ())
    outs = tuple(torch.full((tokens, n), float("nan")) for n in out_widths)
    if len(outs) == 3:
        outs += (None,)
    return (qkv, positions, cache, *w, None, None, hq, hkv, 1e-6, rope), outs


def _call(ns: str, form: str, args, outs) -> Outcome:
    """Run one split form; the outcome (the tensors it wrote or returned) or the exception it raised."""
    op = getattr(getattr(torch.ops, ns), _FORMS[form] if ns != "qkvfuse_cpu" else "split_generic_out").default
    try:
        with torch.no_grad():
            if form == "functional":
                return "ran", tuple(op(*args))
            if form == "out":
                op(*args, *outs)
                return "ran", tuple(t for t in outs if t is not None)
            if form == "cache":  # outs: (key_cache, value_cache, slot_mapping, cache_mode)
                op(*args, *outs, None, None)
                return "ran", (args[0], outs[0], outs[1])
            if form == "cache_out":  # outs: the cache form's, then the out= form's outputs
                op(*args, *outs[:4], None, None, *outs[4:])
                return "ran", (args[0], *(t for t in outs[:2] + outs[4:] if t is not None))
            op(*args)
            return "ran", (args[0],)
    except Exception as exc:  # noqa: BLE001 -- the outcome compared with the reference's
        return "raised", f"{type(exc).__name__}: {exc}"


def _agree(got: Outcome, want: Outcome) -> Tuple[bool, str]:
    """Refused with the reference's type and message, or ran as the reference did, with close outputs."""
    if got[0] == "raised" or want[0] == "raised":
        said = lambda o: o[1] if o[0] == "raised" else "ran"  # noqa: E731
        return got == want, said(got) if got == want else f"{said(got)}; the reference: {said(want)}"
    if len(got[1]) != len(want[1]):
        return False, f"{len(got[1])} outputs, the reference {len(want[1])}"
    for a, b in zip(got[1], want[1]):
        if a.shape != b.shape or not torch.allclose(a, b, rtol=1e-5, atol=1e-5, equal_nan=True):
            return False, f"ran, outputs differ from the reference's (max |diff| {(a - b).abs().max():.3g})"
    return True, "ran, agrees with the reference"


def _split_cases(ns: str, form: str) -> Dict[str, Callable[[], Tuple[bool, str]]]:
    """The split sweeps of one namespace and form, each compared with the reference op on the same arguments."""
    found = {}

    def add(name: str, make: Callable[[], tuple], cache_mode: int = 0) -> None:
        if form in ("cache", "cache_out"):
            make = _with_cache(make, cache_mode, keep_outs=form == "cache_out")

        def check():
            return _agree(_call(ns, form, *make()), _call("qkvfuse_reference", form, *make()))
        found[f"{ns}::{form}: {name}"] = check

    if form in ("cache", "cache_out"):
        for v in EDGES:
            add(f"cache_mode={v}", lambda: _split_args(2, 1, 1, False), cache_mode=v)

    for gated in (False, True):
        layout = "gated" if gated else "plain"
        base_rope = _library.encode_rope(True, q_gate=gated)
        add(f"{layout} base call", lambda g=gated, r=base_rope: _split_args(2, 1, r, g))  # runs: the sweep's anchor
        for v in HEAD_EDGES:
            add(f"{layout} num_q_heads={v}", lambda v=v, g=gated, r=base_rope: _split_args(v, 1, r, g))
            add(f"{layout} num_kv_heads={v}", lambda v=v, g=gated, r=base_rope: _split_args(2, v, r, g))
            add(f"{layout} num_q_heads=num_kv_heads={v}", lambda v=v, g=gated, r=base_rope: _split_args(v, v, r, g))
        for v in EDGES:
            add(f"{layout} rope={v}", lambda v=v, g=gated: _split_args(2, 1, v, g))
        # Gemma norm weights without weights: nothing to apply the flag to.
        add(f"{layout} gemma rope without norm weights",
            lambda g=gated: _split_args(2, 1, _library.encode_rope(True, q_gate=g, gemma=True), g, norm=False))
    # The calls that wrote out of bounds: tensors shaped for the sizes the products wrap to.
    huge = 2**62 + 1
    for tokens in (1, 2):
        add(f"gated Hq = Hkv = 2**62 + 1 on qkv [{tokens}, 16], outputs [{tokens}, 4]",
            lambda t=tokens: _split_args(huge, huge, _library.encode_rope(True, q_gate=True), True, width=16,
                                         out_widths=(4, 4, 4, 4), norm=False, tokens=t))
        add(f"plain Hq = 3, Hkv = 2**63 - 1 on qkv [{tokens}, 16]",
            lambda t=tokens: _split_args(3, 2**63 - 1, 1, False, width=16, out_widths=(48, 16, 16), norm=False,
                                         tokens=t))
    return found


def _with_cache(make: Callable[[], tuple], cache_mode: int, keep_outs: bool = False) -> Callable[[], tuple]:
    """``make``'s split call with the cache form's arguments (poisoned fp32 NHD caches for one KV head, every token
    to a slot) in place of the out= outputs (``keep_outs``: followed by them, the out-of-place cache form)."""
    def made():
        args, outs = make()
        tokens = args[0].shape[0]
        caches = tuple(torch.full((BLOCKS, BLOCK_SIZE, 1, D), float("nan")) for _ in range(2))
        cache_args = (*caches, torch.arange(tokens, dtype=torch.int64) % (BLOCKS * BLOCK_SIZE), cache_mode)
        return args, cache_args + (outs if keep_outs else ())
    return made


def _expect(call: Callable[[], object], want: Callable[[], object], refused_arg: str) -> Tuple[bool, str]:
    """An op with no reference namespace: refused with a ValueError naming ``refused_arg``, or equal to ``want()``
    (the Python definition)."""
    try:
        got = call()
    except ValueError as exc:
        ok = str(exc).startswith(f"{refused_arg}: expected ")
        return ok, f"ValueError: {exc}"
    except Exception as exc:  # noqa: BLE001 -- any other type is the failure reported
        return False, f"raised {type(exc).__name__} instead of ValueError: {exc}"
    expected = want()
    return got == expected, f"ran: {got}" + ("" if got == expected else f" != {expected}")


def _native_cases() -> Dict[str, Callable[[], Tuple[bool, str]]]:
    """The native library's own ops (``qkvfuse_cpu``), against their Python definitions."""
    from ..rope import mrope_axis_map

    ops = torch.ops.qkvfuse_cpu
    found = {}
    for v in EDGES:
        found[f"qkvfuse_cpu::mrope_axis_map: half={v}"] = (
            lambda v=v: _expect(lambda: tuple(ops.mrope_axis_map(v, [1, 1, 0], True)),
                                # past the kernels' half (256) the Python loop would run for ever: not computed
                                lambda: mrope_axis_map(v, (1, 1, 0), True) if v <= 1 << 16 else "not computed",
                                "half"))
        for i in range(3):
            section = [1, 1, 1]
            section[i] = v
            found[f"qkvfuse_cpu::mrope_axis_map: mrope_section={section}"] = (
                lambda s=tuple(section): _expect(lambda: tuple(ops.mrope_axis_map(6, list(s), True)),
                                                 lambda: mrope_axis_map(6, s, True), "mrope_section"))
        found[f"qkvfuse_cpu::decode_rope: rope={v}"] = (
            lambda v=v: _expect(lambda: tuple(ops.decode_rope(v)), lambda: _decoded(v), "rope"))
        found[f"qkvfuse_cpu::grain_items: elems_per_item={v}"] = (
            lambda v=v: _expect(lambda: ops.grain_items(v), lambda: _grain(v), "elems_per_item"))
    found.update(_split_cases("qkvfuse_cpu", "out"))  # split_generic_out: the out= schema
    return found


def _decoded(code: int) -> tuple:
    """:func:`qkvfuse._library.decode_rope` / ``decode_flags`` in the native op's order (no sections: zeros)."""
    neox, sections, interleaved = _library.decode_rope(code)
    q_gate, gemma = _library.decode_flags(code)
    return (int(neox), int(bool(sections)), int(interleaved), *(sections or (0, 0, 0)), int(q_gate), int(gemma))


def _grain(n: int) -> int:
    """The parallel grain in items: 16 384 elements' worth (``vec_io.h``'s ``kGrainElems``), at least one."""
    return 1 if n >= 16384 else -(-16384 // n)


def _public_cases(backend: str) -> Dict[str, Callable[[], Tuple[bool, str]]]:
    """The public functions and bound objects with each head count at each edge: refused with the raw reference
    op's message (one rule, one message)."""
    import qkvfuse

    found = {}
    for arg in ("num_q_heads", "num_kv_heads"):
        for v in EDGES + (MAX_HEADS + 1,):  # at MAX_HEADS both refuse qkv's width, the public message with head_dim
            geometry = {"num_q_heads": 2, "num_kv_heads": 1, arg: v}

            def raw(geometry=geometry):
                return _call("qkvfuse_reference", "functional",
                             *_split_args(geometry["num_q_heads"], geometry["num_kv_heads"], 1, False))

            def public(geometry=geometry, bound=False):
                args, _ = _split_args(2, 1, 1, False)
                qkv, positions, cache, q_w, k_w = args[:5]
                try:
                    if bound:
                        prep = qkvfuse.QKNormRope(geometry["num_q_heads"], geometry["num_kv_heads"], D, cache,
                                                  q_weight=q_w, k_weight=k_w, backend=backend)
                        return "ran", tuple(prep(qkv, positions))
                    return "ran", tuple(qkvfuse.split_qkv_rmsnorm_rope(
                        qkv, positions, cache, geometry["num_q_heads"], geometry["num_kv_heads"], D, q_weight=q_w,
                        k_weight=k_w, backend=backend))
                except Exception as exc:  # noqa: BLE001 -- compared with the raw op's
                    return "raised", f"{type(exc).__name__}: {exc}"

            found[f"public split_qkv_rmsnorm_rope: {arg}={v}"] = lambda p=public, r=raw: _agree(p(), r())
            found[f"public QKNormRope: {arg}={v}"] = lambda p=public, r=raw: _agree(p(bound=True), r())
    return found


def cases(backend: str) -> Dict[str, Callable[[], Tuple[bool, str]]]:
    """Every sweep call of ``backend``: ``{name: check -> (ok, detail)}``."""
    ns = _library.NAMESPACES[select_ops(backend, "cpu")]
    found = {}
    for form in _FORMS:
        found.update(_split_cases(ns, form))
    found.update(_public_cases(backend))
    if backend == "cpu":
        from ..backends import get_backend

        get_backend("cpu")  # loads the native library, which defines the qkvfuse_cpu ops
        found.update(_native_cases())
    return found


def run(backend: str) -> Dict[str, Tuple[bool, str]]:
    """Run :func:`cases`, printing a JSON ``start`` line before and a result line after each."""
    results = {}
    for name, check in cases(backend).items():
        print(json.dumps({"start": name}), flush=True)
        try:
            ok, detail = check()
        except Exception as exc:  # noqa: BLE001 -- a check that errors is a failed case, with its reason
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        results[name] = (ok, detail)
        print(json.dumps({"name": name, "ok": ok, "detail": detail}), flush=True)
    return results


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m qkvfuse._verify.int_edges BACKEND", file=sys.stderr)
        return 2
    run(argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
