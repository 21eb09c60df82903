"""A recording fake device module, so the stream protocol of the overlap helper can be checked on CPU.

``FakeDeviceModule`` has the part of the ``torch.cuda`` API the helper uses (``Stream``, ``current_stream``,
``current_device``, ``stream``); every stream operation is appended to one log. ``recording(fake)`` also logs
every torch call (through a ``TorchFunctionMode``) with the stream that was current when it ran and the
storages it read and produced, and intercepts ``Tensor.record_stream``, which raises on CPU tensors.
``protocol_violations`` turns a log into the list of broken rules (empty when the protocol holds).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import List, Optional, Tuple

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten


class FakeStream:
    def __init__(self, module: "FakeDeviceModule", name: str, device):
        self.module, self.name, self.device = module, name, device

    def wait_stream(self, other: "FakeStream") -> None:
        self.module.log.append(("wait", self.name, other.name))

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeDeviceModule:
    """Streams that run nothing concurrently but remember what was asked of them, per thread like CUDA."""

    def __init__(self):
        self.log: List[Tuple] = []
        self.created: List[FakeStream] = []
        self.main = FakeStream(self, "main", None)
        self._local = threading.local()

    def Stream(self, device=None, priority=0):  # noqa: N802 (mirrors torch.cuda.Stream)
        stream = FakeStream(self, f"side{len(self.created)}", device)
        self.created.append(stream)
        self.log.append(("new_stream", stream.name, str(device)))
        return stream

    def current_device(self) -> int:
        return 0

    def current_stream(self, device=None) -> FakeStream:
        return getattr(self._local, "stream", self.main)

    @contextlib.contextmanager
    def stream(self, stream: FakeStream):
        previous = self.current_stream()
        self._local.stream = stream
        self.log.append(("enter", stream.name))
        try:
            yield
        finally:
            self._local.stream = previous
            self.log.append(("exit", stream.name))


def _storages(tree) -> Tuple[int, ...]:
    leaves, _ = tree_flatten(tree)
    return tuple(t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor))


_METADATA = {"__get__", "device", "dtype", "shape", "untyped_storage", "data_ptr", "size", "dim", "stride", "numel"}


class _OpRecorder(TorchFunctionMode):
    def __init__(self, fake: FakeDeviceModule):
        super().__init__()
        self.fake = fake

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", str(func))
        # Metadata reads (.shape, .size(), ...) touch no device memory: they are not a "use" of a tensor.
        if name not in _METADATA:
            stream = self.fake.current_stream().name
            self.fake.log.append(("op", name, stream, _storages((args, kwargs)), _storages(out)))
        return out


@contextlib.contextmanager
def intercepting_record_stream(fake: FakeDeviceModule):
    """Replace ``Tensor.record_stream`` (process-wide, so in every thread) by a logger into ``fake.log``."""

    def record_stream(tensor, stream):
        fake.log.append(("record_stream", tensor.untyped_storage().data_ptr(), stream.name))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "record_stream", record_stream)
        yield


@contextlib.contextmanager
def recording(fake: FakeDeviceModule):
    """Log torch calls (of this thread) and ``record_stream`` calls into ``fake.log`` while the block runs."""
    with intercepting_record_stream(fake), _OpRecorder(fake):
        yield


@dataclass
class Call:
    """What the check needs to know about one overlapped call besides the log."""

    hidden: torch.Tensor
    shared_out: torch.Tensor
    result: torch.Tensor


def _index(log, entry) -> Optional[int]:
    return next((i for i, e in enumerate(log) if e[: len(entry)] == entry), None)


def protocol_violations(log: List[Tuple], call: Call) -> List[str]:
    """Every rule of the overlap protocol that ``log`` (one call) breaks; empty when it holds."""
    bad: List[str] = []
    sides = {e[1] for e in log if e[0] == "enter"}
    if len(sides) != 1 or "main" in sides:
        return [f"expected one side stream entered once, got {sorted(sides)}"]
    side = sides.pop()
    fork, enter = _index(log, ("wait", side, "main")), _index(log, ("enter", side))
    leave, join = _index(log, ("exit", side)), _index(log, ("wait", "main", side))
    if None in (fork, enter, leave, join):
        return [f"missing fork/enter/exit/join: {fork, enter, leave, join}"]
    if not fork < enter < leave < join:
        bad.append(f"order must be fork < enter < exit < join, got {fork, enter, leave, join}")

    hidden = call.hidden.untyped_storage().data_ptr()
    shared = call.shared_out.untyped_storage().data_ptr()
    result = call.result.untyped_storage().data_ptr()
    rec_hidden = _index(log, ("record_stream", hidden, side))
    if rec_hidden is None or rec_hidden > join:
        bad.append("hidden (allocated on main, read on side) not record_stream'ed on the side stream before the join")
    rec_shared = _index(log, ("record_stream", shared, "main"))
    if rec_shared is None or rec_shared < join:
        bad.append("shared output (allocated on side, read on main) not record_stream'ed on main after the join")

    ops = [(i, e) for i, e in enumerate(log) if e[0] == "op"]
    for i, (_, name, stream, _, _) in ops:
        expected = side if enter < i < leave else "main"
        if stream != expected:
            bad.append(f"op {name} at {i} ran on {stream}, expected {expected}")
    side_ops = [e for i, e in ops if enter < i < leave]
    if not any(hidden in e[3] for e in side_ops):
        bad.append("the shared expert never read hidden on the side stream")
    if not any(shared in e[4] for e in side_ops):
        bad.append("the shared output was not produced on the side stream")
    if not any(leave < i < join for i, _ in ops):
        bad.append("no routed work ran on main between the launch and the join")
    for i, (_, name, stream, reads, _) in ops:
        if i > leave and shared in reads and i < join:
            bad.append(f"op {name} at {i} read the shared output before the join")
    producers = [i for i, e in ops if result in e[4]]
    if not producers or producers[-1] < join:
        bad.append("combined output not allocated on main after the join")
    return bad
