"""The overlap helper: its stream protocol (with a recording fake device module), switch and stream cache."""

import threading

import pytest
import torch

from _support.moe_stream_fakes import Call, FakeDeviceModule, protocol_violations, recording
from qkvfuse.moe import ENV_VAR, SharedExpertOverlap, overlap_enabled


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _fns():
    captured = {}

    def shared_fn(x):
        captured["shared"] = torch.nn.functional.silu(x) * 3.0
        return captured["shared"]

    def routed_fn(x):
        return (x * x).sum(-1, keepdim=True) + x

    return shared_fn, routed_fn, captured


def _run_recorded(runner_cls=SharedExpertOverlap):
    fake = FakeDeviceModule()
    runner = runner_cls(enabled=True, device_module=fake)
    hidden = torch.randn(3, 16)
    shared_fn, routed_fn, captured = _fns()
    with recording(fake):
        result = runner.run(hidden, shared_fn, routed_fn)
    return fake, Call(hidden, captured["shared"], result), runner


def test_protocol_order_on_fake_device():
    fake, call, _ = _run_recorded()
    assert protocol_violations(fake.log, call) == []
    # The whole sequence, spelled out once: fork, record hidden, launch, routed, join, record shared, combine
    # (runs of torch ops collapsed to one "op").
    collapsed = []
    for entry in fake.log:
        if not (entry[0] == "op" and collapsed and collapsed[-1] == "op"):
            collapsed.append(entry[0])
    assert collapsed == ["new_stream", "wait", "record_stream", "enter", "op", "exit", "op", "wait",
                         "record_stream", "op"]


def test_protocol_result_bitwise_equals_inline():
    fake, call, _ = _run_recorded()
    shared_fn, routed_fn, _ = _fns()
    inline = SharedExpertOverlap(enabled=False).run(call.hidden, shared_fn, routed_fn)
    assert torch.equal(_bits(call.result), _bits(inline))


class _NoRecordHidden(SharedExpertOverlap):
    def run(self, hidden, shared_fn, routed_fn, combine=torch.add):
        module = self.stream_module(hidden.device)
        current, side = module.current_stream(), self.side_stream(hidden.device, module)
        side.wait_stream(current)
        with module.stream(side):
            shared = shared_fn(hidden)
        routed = routed_fn(hidden)
        current.wait_stream(side)
        shared.record_stream(current)
        return combine(routed, shared)


class _CombineBeforeJoin(SharedExpertOverlap):
    def run(self, hidden, shared_fn, routed_fn, combine=torch.add):
        module = self.stream_module(hidden.device)
        current, side = module.current_stream(), self.side_stream(hidden.device, module)
        side.wait_stream(current)
        hidden.record_stream(side)
        with module.stream(side):
            shared = shared_fn(hidden)
        out = combine(routed_fn(hidden), shared)
        current.wait_stream(side)
        shared.record_stream(current)
        return out


class _NoFork(SharedExpertOverlap):
    def run(self, hidden, shared_fn, routed_fn, combine=torch.add):
        module = self.stream_module(hidden.device)
        current, side = module.current_stream(), self.side_stream(hidden.device, module)
        hidden.record_stream(side)
        with module.stream(side):
            shared = shared_fn(hidden)
        routed = routed_fn(hidden)
        current.wait_stream(side)
        shared.record_stream(current)
        return combine(routed, shared)


@pytest.mark.parametrize("broken, message", [
    (_NoRecordHidden, "hidden (allocated on main, read on side) not record_stream'ed"),
    (_CombineBeforeJoin, "read the shared output before the join"),
    (_NoFork, "missing fork"),
])
def test_protocol_check_catches_broken_helpers(broken, message):
    """The checker is not vacuous: each classic mistake of dual-stream shared experts is reported."""
    fake, call, _ = _run_recorded(broken)
    assert any(message in v for v in protocol_violations(fake.log, call)), protocol_violations(fake.log, call)


def test_join_happens_even_if_routed_path_raises():
    fake = FakeDeviceModule()
    runner = SharedExpertOverlap(enabled=True, device_module=fake)

    def routed_fn(x):
        raise RuntimeError("routed failed")

    with recording(fake), pytest.raises(RuntimeError, match="routed failed"):
        runner.run(torch.randn(2, 4), torch.neg, routed_fn)
    stream_events = [e for e in fake.log if e[0] in ("wait", "enter", "exit")]
    assert stream_events[-1] == ("wait", "main", "side0")
    assert fake.current_stream() is fake.main


def test_side_stream_is_lazy_and_per_device():
    fake = FakeDeviceModule()
    runner = SharedExpertOverlap(enabled=True, device_module=fake)
    assert fake.created == []
    s0 = runner.side_stream(torch.device("cuda", 0))
    assert runner.side_stream(torch.device("cuda", 0)) is s0
    assert runner.side_stream(torch.device("cuda")) is s0  # index-less device means the current one
    s1 = runner.side_stream(torch.device("cuda", 1))
    assert s1 is not s0 and len(fake.created) == 2


def test_side_stream_created_once_under_concurrent_first_use():
    fake = FakeDeviceModule()
    runner = SharedExpertOverlap(enabled=True, device_module=fake)
    barrier = threading.Barrier(8)
    got = []

    def first_use():
        barrier.wait()
        got.append(runner.side_stream(torch.device("cuda", 0)))

    threads = [threading.Thread(target=first_use) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fake.created) == 1 and all(s is got[0] for s in got)


def test_cpu_tensors_run_inline_without_streams():
    runner = SharedExpertOverlap(enabled=True)
    assert runner.stream_module(torch.device("cpu")) is None
    assert SharedExpertOverlap(enabled=False).stream_module(torch.device("cuda", 0)) is None
    assert SharedExpertOverlap(enabled=True).stream_module(torch.device("cuda", 0)) is torch.cuda
    hidden = torch.randn(5, 8)
    shared_fn, routed_fn, _ = _fns()
    out = runner.run(hidden, shared_fn, routed_fn)
    ref = routed_fn(hidden) + shared_fn(hidden)
    assert torch.equal(_bits(out), _bits(ref))


def test_switch_argument_and_environment(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert overlap_enabled() is False and SharedExpertOverlap().enabled is False
    monkeypatch.setenv(ENV_VAR, "1")
    assert overlap_enabled() is True and SharedExpertOverlap().enabled is True
    assert overlap_enabled(False) is False  # an explicit argument wins over the environment
    monkeypatch.setenv(ENV_VAR, "0")
    assert overlap_enabled() is False and overlap_enabled(True) is True
    monkeypatch.setenv(ENV_VAR, "maybe")
    with pytest.raises(ValueError, match="QKVFUSE_SHARED_EXPERT_OVERLAP='maybe'"):
        overlap_enabled()
    with pytest.raises(TypeError, match="overlap must be a bool"):
        overlap_enabled(1)
