"""CPU smoke run of the ``moe-streams`` device section, so the GPU run cannot fail on a Python error.

The device calls (sleep, events, graphs) are replaced by host stand-ins and the streams by the recording fake;
everything else -- building the layer from a preset, the sequential baseline, the race loop, the control,
the section's rows and note -- is the code the GPU runs.
"""

import json

import pytest
import torch

pytest.importorskip("transformers")

from _support.moe_stream_fakes import FakeDeviceModule, intercepting_record_stream
from qkvfuse._verify import moe_streams
from qkvfuse._verify.sections import Options, print_section
from qkvfuse.moe import SharedExpertOverlap
from qkvfuse.presets import get_preset

TINY = get_preset("GLM-4.7").replace(name="GLM-4.7-tiny", hidden_size=64, num_experts=8, num_experts_per_tok=2,
                                     moe_intermediate_size=32)


@pytest.mark.parametrize("opts", [Options(cpu_interpreter=True), Options(device="cuda")], ids=["cpu", "cuda"])
def test_section_reports_skipped_without_cuda(opts):
    if torch.cuda.is_available() and opts.device == "cuda":
        pytest.skip("a CUDA device is present: the section would run for real")
    section = moe_streams.section(opts)
    assert section.rows == [] and section.failures == 0 and section.note.startswith("skipped")


def test_check_runs_on_host_with_fake_streams(capsys):
    block = moe_streams.build_moe_block(TINY, torch.device("cpu"), dtype=torch.bfloat16)
    assert block.experts.gate_up_proj.shape == (8, 64, 64) and block.experts.gate_up_proj.dtype == torch.bfloat16
    assert block.gate.e_score_correction_bias.dtype == torch.float32
    fake = FakeDeviceModule()
    runner = SharedExpertOverlap(enabled=True, device_module=fake)
    with intercepting_record_stream(fake):
        section = moe_streams._run(moe_streams._HostApi(torch.device("cpu")), block, TINY, quick=True, runner=runner,
                                   token_counts=(1, 5), race_iterations=6, reps=2, control_iterations=3)
    rows = {(r["check"], r["T"]): r for r in section.rows}
    assert section.failures == 0, section.rows
    assert [T for check, T in rows if check == "layer"] == [1, 5]
    layers = [r for r in section.rows if r["check"] == "layer"]
    assert all(r["seq_repeat_equal"] and r["eager_on_us"] > 0 for r in layers)  # a time is reported, not judged
    assert rows[("race (join present)", "1, 5")]["detail"] == "0 / 6 mismatching"
    assert "control (join left out)" in {check for check, _ in rows}
    # where eager loses: the profiles of an eager call, overlap off and on, and what grew
    for check in ("eager profile, overlap off", "eager profile, overlap on", "eager profile, on - off"):
        assert rows[(check, 1)]["pass"] and "us/call" in rows[(check, 1)]["detail"], rows[(check, 1)]
    assert "largest host ops" in rows[("eager profile, overlap on", 1)]["detail"]
    assert sum(e[:2] == ("wait", "main") for e in fake.log) >= 6  # the race loop went through the streams
    print_section(section)
    assert "race (join present)" in capsys.readouterr().out
    json.dumps([section.rows, section.note])
