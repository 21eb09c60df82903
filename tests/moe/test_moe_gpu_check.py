"""CPU smoke run of the overlap device check, so the GPU run cannot fail on a Python error.

The device calls (sleep, events, graphs) are replaced by host stand-ins and the streams by the recording fake;
everything else -- building the layer from a preset, the sequential baseline, the race loop, the control,
the result dict and its table -- is the code the GPU runs.
"""

import json

import pytest
import torch

pytest.importorskip("transformers")

from moe_stream_fakes import FakeDeviceModule, intercepting_record_stream
from qkvfuse.moe import SharedExpertOverlap, gpu_check
from qkvfuse.presets import get_preset

TINY = get_preset("GLM-4.7").replace(name="GLM-4.7-tiny", hidden_size=64, num_experts=8, num_experts_per_tok=2,
                                     moe_intermediate_size=32)


def test_section_reports_skipped_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the section would run for real")
    result = gpu_check.section(quick=True)
    assert result["skipped"] and result["pass"] is None and "skipped" in result["table"]
    json.dumps(result)


def test_check_runs_on_host_with_fake_streams():
    block = gpu_check.build_moe_block(TINY, torch.device("cpu"), dtype=torch.bfloat16)
    assert block.experts.gate_up_proj.shape == (8, 64, 64) and block.experts.gate_up_proj.dtype == torch.bfloat16
    assert block.gate.e_score_correction_bias.dtype == torch.float32
    fake = FakeDeviceModule()
    runner = SharedExpertOverlap(enabled=True, device_module=fake)
    with intercepting_record_stream(fake):
        result = gpu_check._run(gpu_check._HostApi(torch.device("cpu")), block, TINY, quick=True, runner=runner,
                                token_counts=(1, 5), race_iterations=6, reps=2,
                                control_iterations=3)
    assert result["errors"] == [] and result["pass"] is True, result["table"]
    assert result["race"]["mismatches"] == 0
    assert [r["T"] for r in result["rows"]] == [1, 5]
    reported = [r["eager_on_us"] for r in result["rows"]]  # a time is reported; its value is not judged here
    assert all(r["seq_repeat_equal"] for r in result["rows"]) and all(t > 0 for t in reported)
    assert sum(e[:2] == ("wait", "main") for e in fake.log) >= 6  # the race loop went through the streams
    json.dumps(result)
    print(result["table"])
    assert "race: 0 mismatching outputs in 6 overlapped calls" in result["table"]
