"""The split's rope mode and its one-int encoding (the ``rope`` argument of the split schemas).

The bottom of the ops: this module imports nothing of qkvfuse, and :mod:`qkvfuse._checks` (the per-call rules) and
:mod:`qkvfuse._library` (the schemas and kernel registration) both import it, so the bits are defined once.

The code: bit 0 NeoX pairs, bit 1 mRoPE, bit 2 interleaved mRoPE, bit 3 the gated Q layout (:data:`Q_GATE`),
bit 4 Gemma norm weights (:data:`GEMMA`), then the three section sizes in 10 bits each (``rotary_dim // 2 <=
256``). Options that need no tensor travel in it, so the schema and the C++ entry do not change for them. The C++
kernels decode the same layout (``decode_rope`` in ``backends/cpu/split_qkv_rmsnorm_rope.cpp``); a test
round-trips codes through both.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence, Tuple

__all__ = ["NEOX", "MROPE", "MROPE_INTERLEAVED", "Q_GATE", "GEMMA", "RopeMode", "encode_rope", "decode_rope",
           "decode_flags", "decode_mode"]

NEOX = 1
MROPE = 2
MROPE_INTERLEAVED = 4
Q_GATE = 8  # qkv's Q region is [q_0 | g_0 | q_1 | g_1 | ...], 2 * num_q_heads * head_dim wide; the gate is copied
GEMMA = 16  # q_weight / k_weight are stored centred at 0: heads are normalised and multiplied by 1 + w in fp32
_SECTION_BITS = 10
_SECTION_SHIFT = (8, 18, 28)


class RopeMode(NamedTuple):
    """A decoded rope code: what the kernels branch on."""

    is_neox: bool
    mrope_section: Tuple[int, ...]  # () for plain RoPE
    mrope_interleaved: bool
    q_gate: bool
    gemma: bool

    def code(self) -> int:
        return encode_rope(*self)


def encode_rope(is_neox: bool, mrope_section: Sequence[int] = (), mrope_interleaved: bool = False,
                q_gate: bool = False, gemma: bool = False) -> int:
    """The ``rope`` argument of the split ops for validated arguments (``mrope_section`` empty for RoPE)."""
    code = (NEOX if is_neox else 0) | (Q_GATE if q_gate else 0) | (GEMMA if gemma else 0)
    if mrope_section:
        code |= MROPE | (MROPE_INTERLEAVED if mrope_interleaved else 0)
        for size, shift in zip(mrope_section, _SECTION_SHIFT):
            code |= int(size) << shift
    return code


def decode_rope(code: int) -> Tuple[bool, Tuple[int, ...], bool]:
    """``(is_neox, mrope_section, mrope_interleaved)``; ``mrope_section`` is ``()`` for plain RoPE."""
    mask = (1 << _SECTION_BITS) - 1
    sections = tuple((code >> shift) & mask for shift in _SECTION_SHIFT) if code & MROPE else ()
    return bool(code & NEOX), sections, bool(code & MROPE_INTERLEAVED)


def decode_flags(code: int) -> Tuple[bool, bool]:
    """``(q_gate, gemma)`` of a rope code."""
    return bool(code & Q_GATE), bool(code & GEMMA)


# Cached: every Python kernel call decodes its code, and a process sees a handful of codes.
@functools.lru_cache(maxsize=1024)
def decode_mode(code: int) -> RopeMode:
    """The whole :class:`RopeMode` of a rope code."""
    return RopeMode(*decode_rope(code), *decode_flags(code))
