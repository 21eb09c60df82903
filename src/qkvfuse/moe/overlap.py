"""Shared-expert overlap: run an MoE block's shared expert on a side stream beside the routed experts.

When it helps
    The shared expert of GLM-4.x (one dense MLP of ``moe_intermediate_size``) and the routed experts read the
    same input and meet only in the final sum. At small token counts (decode, T of 1 to a few hundred) neither
    path fills the device: the routed experts are a chain of small, memory-bound grouped GEMMs plus routing
    glue, and the shared expert can run on the SMs they leave idle. Putting it on a second stream hides most of
    its time. It needs a device with streams and free execution units (CUDA, XPU, Ascend NPU).
When it does not
    At large T (prefill of thousands of tokens) both paths saturate the device on their own; the second stream
    only adds an event record/wait pair and can slow the routed GEMMs by competing for SMs and L2. On CPU there
    are no streams: the helper runs both paths inline, so the switch changes nothing there. Under
    ``torch.compile`` it also runs inline (see :meth:`SharedExpertOverlap.stream_module`).

Synchronisation (the whole protocol, in order)
    1. ``side.wait_stream(current)``: the side stream sees every write to ``hidden`` made on the current stream.
    2. ``hidden.record_stream(side)``: ``hidden`` was allocated on the current stream and is read on the side
       stream; without the record, the caching allocator could hand its memory to a new tensor on the
       current stream while the shared expert still reads it.
    3. the shared expert is launched under ``with device_module.stream(side)``; the routed experts then run on
       the current stream.
    4. ``current.wait_stream(side)``: nothing on the current stream reads the shared output before this join
       (it runs in a ``finally``, so an error in either path still rejoins the side stream, which a CUDA
       graph capture requires).
    5. ``shared.record_stream(current)``: the shared output was allocated on the side stream and is read (and
       freed) on the current stream.
    6. ``combine(routed, shared)`` runs on the current stream, so the combined output is allocated there:
       CUDA-graph trees cannot capture allocations made on a side stream, and the side stream forks from and
       rejoins the capturing stream, so the overlap also works inside ``torch.cuda.graph`` captures.

The inline path (CPU, or overlap disabled) runs the same three calls in the same order -- shared, routed,
combine -- on the same inputs, so both paths give bitwise the same result.
"""

from __future__ import annotations

import operator
import os
import threading
from typing import Callable, Dict, Optional, Tuple

import torch

__all__ = ["ENV_VAR", "STREAM_DEVICE_TYPES", "SharedExpertOverlap", "overlap_enabled", "process_runner"]

ENV_VAR = "QKVFUSE_SHARED_EXPERT_OVERLAP"

# Device types whose torch device module (``torch.get_device_module``) exposes the stream API the helper uses:
# ``Stream(device=)``, ``current_stream(device)``, ``stream(s)``. ``torch.cpu`` has stub streams that do not
# run anything concurrently, so CPU is deliberately not in the list.
STREAM_DEVICE_TYPES = ("cuda", "xpu", "npu")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def overlap_enabled(overlap: Optional[bool] = None) -> bool:
    """Resolve the overlap switch: ``overlap`` if given, else ``QKVFUSE_SHARED_EXPERT_OVERLAP`` (default off).

    Parameters
    ----------
    overlap : bool or None
        Explicit choice; ``None`` reads the environment variable (``1``/``true``/``yes``/``on`` enable it,
        ``0``/``false``/``no``/``off`` or unset disable it; anything else raises ``ValueError``).
    """
    if overlap is not None:
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool or None, got {type(overlap).__name__} {overlap!r}")
        return overlap
    raw = os.environ.get(ENV_VAR, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{ENV_VAR}={raw!r} is not a boolean; expected one of {_TRUE + _FALSE[1:]} or unset")


class SharedExpertOverlap:
    """Runs ``combine(routed_fn(hidden), shared_fn(hidden))`` with ``shared_fn`` on a side stream.

    One instance keeps one lazily created side stream per device and can be shared by every MoE layer of a
    model (layers run one after the other, so they never need two side streams at once) and by several
    threads (each thread has its own current stream; the side stream only orders the shared experts).

    Parameters
    ----------
    enabled : bool or None
        Overlap on or off; ``None`` (default) reads ``QKVFUSE_SHARED_EXPERT_OVERLAP`` once, here. When off,
        :meth:`run` is the inline path on every device.
    device_module : module or None
        Stream API to use instead of ``torch.get_device_module(hidden.device)``: any object with ``Stream``,
        ``current_stream`` and ``stream`` like ``torch.cuda``. Given, it is used for tensors on every device
        (the protocol test passes a recording fake for CPU tensors); ``None`` uses streams only for
        ``cuda``, ``xpu`` and ``npu`` tensors and runs inline elsewhere.

    Notes
    -----
    Forward (inference) only is what this is built and tested for; autograd records the streams of the
    forward ops and replays backward on them, which torch supports but qkvfuse does not test.
    """

    def __init__(self, enabled: Optional[bool] = None, *, device_module=None):
        self.enabled = overlap_enabled(enabled)
        self._device_module = device_module
        self._side_streams: Dict[Tuple[str, Optional[int]], object] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(enabled={self.enabled})"

    # A patched model holds its helper; copying or pickling the model must not try to copy a lock or device
    # streams. Copies share the streams (they are a per-process resource); unpickled helpers create new ones.
    def __deepcopy__(self, memo):
        return self

    def __getstate__(self):
        return {"enabled": self.enabled, "_device_module": self._device_module}

    def __setstate__(self, state):
        self.__init__(state["enabled"], device_module=state["_device_module"])

    def stream_module(self, device: torch.device):
        """The device module whose streams :meth:`run` uses for tensors on ``device``, or ``None`` (inline)."""
        # Under torch.compile the calls run inline: Dynamo's tracing of user streams is not something qkvfuse
        # relies on, and a graph break per MoE layer would defeat full-graph compilation. For overlap inside a
        # graph, capture the eager model with torch.cuda.graph (the protocol below is capture-safe).
        if not self.enabled or torch.compiler.is_compiling():
            return None
        if self._device_module is not None:
            return self._device_module
        if device.type not in STREAM_DEVICE_TYPES:
            return None
        return torch.get_device_module(device)

    def side_stream(self, device: torch.device, device_module=None):
        """The side stream of ``device``, created on first use (one per device index, per instance)."""
        device = torch.device(device)
        module = device_module if device_module is not None else self.stream_module(device)
        if module is None:
            raise RuntimeError(f"no side stream for device {device}: overlap disabled or device without streams")
        if device.index is None:
            device = torch.device(device.type, module.current_device())
        key = (device.type, device.index)
        stream = self._side_streams.get(key)
        if stream is None:
            # Two threads reaching the first call of a device must end up sharing one stream.
            with self._lock:
                stream = self._side_streams.get(key)
                if stream is None:
                    stream = module.Stream(device=device)
                    self._side_streams[key] = stream
        return stream

    def run(
        self,
        hidden: torch.Tensor,
        shared_fn: Callable[[torch.Tensor], torch.Tensor],
        routed_fn: Callable[[torch.Tensor], torch.Tensor],
        combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = operator.add,
    ) -> torch.Tensor:
        """Compute ``combine(routed_fn(hidden), shared_fn(hidden))``, overlapping the two calls when possible.

        Parameters
        ----------
        hidden : torch.Tensor
            MoE block input, any shape and dtype, on any device; it is read by both paths and must not be
            written by either.
        shared_fn : callable
            ``shared_fn(hidden) -> Tensor``, the shared expert. It runs on the side stream, so it must not
            synchronise with the host or issue collectives (two streams issuing collectives can deadlock).
        routed_fn : callable
            ``routed_fn(hidden) -> Tensor``, router plus routed experts, on the current stream.
        combine : callable
            ``combine(routed, shared) -> Tensor``, default ``routed + shared``; runs on the current stream after
            the join and allocates the output there.

        Returns
        -------
        torch.Tensor
            Whatever ``combine`` returns, bitwise the same with overlap on or off.
        """
        module = self.stream_module(hidden.device)
        if module is None:
            shared = shared_fn(hidden)
            routed = routed_fn(hidden)
            return combine(routed, shared)

        current = module.current_stream(hidden.device)
        side = self.side_stream(hidden.device, module)
        side.wait_stream(current)
        hidden.record_stream(side)
        try:
            with module.stream(side):
                shared = shared_fn(hidden)
            routed = routed_fn(hidden)
        finally:
            current.wait_stream(side)
        shared.record_stream(current)
        return combine(routed, shared)


_process_runner: Optional[SharedExpertOverlap] = None
_process_runner_lock = threading.Lock()


def process_runner() -> SharedExpertOverlap:
    """The process's one enabled helper, for every patched MoE block (hence one side stream per device)."""
    global _process_runner
    with _process_runner_lock:
        if _process_runner is None:
            _process_runner = SharedExpertOverlap(enabled=True)
        return _process_runner
