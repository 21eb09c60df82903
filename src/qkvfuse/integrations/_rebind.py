"""Bound qkvfuse objects that follow the tensors and modules they were built from (engine plugins' helper).

A served model changes under a bound op: weights are synced in place or by ``param.data = new``, ``model._apply``
(``.to()``, offload and reload) gives every parameter new storage, buffers and modules are replaced. A bound
:class:`qkvfuse.QKNormRope` / :class:`qkvfuse.AddRMSNorm` holds its tensors by reference and records, once, what
it validated about them -- shapes, dtypes and the byte spans its in-place overlap check compares against -- so
after any such change it must be rebuilt, never reused. :class:`Rebinding` does the bookkeeping::

    binding = Rebinding(lambda rot, table, qw, kw: QKNormRope(..., table, q_weight=qw, k_weight=kw))
    bound = binding.get(module.rotary_emb, module.rotary_emb.cos_sin_cache, module.q_norm.weight, ...)

``get`` returns the object built from exactly these items, rebuilding it first when any item is not the object
it was built from (identity) or, for a tensor, when its storage or layout changed: ``data_ptr()``, shape,
strides, dtype or device. Plain values -- the scalars a bound call was built with, such as a norm's eps, the
rotary style, an mRoPE section list -- are compared by value: ``norm.variance_epsilon = 0.5`` keeps the norm
object but changes what the engine's own forward computes, so it must re-bind too (a list is recorded as a copy,
so an edit in place is seen). The check is a few attribute reads and comparisons per item -- no tensor op, no
host sync -- so it runs on every eager call. Other items (modules, None) are compared by identity. The items are
held strongly, so an identity cannot be reused by another object while it is recorded.

Under ``torch.compile`` data pointers do not trace: compiled forwards read the parameters directly (the
public functional and in-place ops) instead of a bound object.
"""

from __future__ import annotations

from typing import Any, Callable, Tuple

import torch

__all__ = ["Rebinding", "tensor_signature"]

# Compared by value (an equal value built anew is the same setting); anything else by identity.
_VALUE_TYPES = (bool, int, float, complex, str, bytes, tuple, list, frozenset)
_BY_VALUE = object()  # the signature of an item compared by value


def tensor_signature(t: torch.Tensor) -> tuple:
    """What a bound object relies on besides ``t``'s identity: where its elements are and how they are laid out,
    ``(data_ptr, shape, strides, dtype, device)``."""
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


class Rebinding:
    """The object ``build(*items)`` returns, rebuilt when an item changed (identity; a tensor's storage/layout; a
    plain value's value).

    Parameters
    ----------
    build : callable
        ``build(*items) -> object``; called by :meth:`get` on the first call and after any change. What it
        returns is cached as is (None included, e.g. "this layer no longer qualifies"); if it raises, nothing is
        recorded and the next :meth:`get` calls it again.
    """

    __slots__ = ("build", "items", "signatures", "value", "builds")

    def __init__(self, build: Callable[..., Any]):
        self.build = build
        self.items: Tuple = ()
        self.signatures: Tuple = ()
        self.value: Any = None
        self.builds = 0  # how many times build ran (tests, logs)

    def changed(self, items: Tuple) -> bool:
        """Whether ``items`` differ from the recorded ones (identity, a tensor's :func:`tensor_signature`, or a
        plain value's value)."""
        if len(items) != len(self.items):
            return True
        for item, ref, sig in zip(items, self.items, self.signatures):
            if sig is _BY_VALUE:
                if item is not ref and item != ref:
                    return True
            elif item is not ref or (sig is not None and tensor_signature(item) != sig):
                return True
        return False

    def get(self, *items) -> Any:
        """The object built from ``items`` (rebuilt first if they changed since the last build)."""
        if self.changed(items):
            value = self.build(*items)
            # a list is recorded as a copy: the engine's own list edited in place must compare unequal
            self.items = tuple(list(i) if type(i) is list else i for i in items)
            self.signatures = tuple(tensor_signature(i) if isinstance(i, torch.Tensor) else
                                    _BY_VALUE if isinstance(i, _VALUE_TYPES) else None for i in items)
            self.value = value
            self.builds += 1
        return self.value

    def clear(self) -> None:
        """Forget the recorded items (the next :meth:`get` rebuilds); drops the references to them."""
        self.items, self.signatures, self.value = (), (), None

    def __getstate__(self):
        # copies and pickles rebuild on first use (bound objects hold dispatcher handles)
        return {"build": self.build}

    def __setstate__(self, state):
        self.build = state["build"]
        self.clear()
        self.builds = 0

