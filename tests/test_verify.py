"""``python -m qkvfuse verify`` / ``bench`` plumbing: the section registry, device selection and its errors.

The sections themselves are exercised elsewhere: the host sections' checks by the suites that call the same
functions, the device sections by ``tests/backends/test_triton.py`` (``--cpu-interpreter`` dry run) and
``tests/moe/test_moe_streams_section.py``.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from qkvfuse._verify import sections
from qkvfuse._verify.sections import REGISTRY, Options, Section
from qkvfuse.cli import main


def test_registry_splits_host_and_device_sections_and_every_entry_loads():
    assert sections.sections_for(Options()) == ["ops", "models", "failure-modes"]
    device = ["conformance", "stability", "moe-streams"]
    assert sections.sections_for(Options(device="cuda")) == device
    assert sections.sections_for(Options(cpu_interpreter=True)) == device
    for name in REGISTRY:
        assert callable(sections.load(name)), name


def test_options_tiers_and_devices():
    assert Options(cpu_interpreter=True).tier == "cpu" and Options(cpu_interpreter=True).torch_device.type == "cpu"
    assert Options(device="cuda", quick=True).tier == "quick" and Options(device="cuda").tier == "full"
    assert not Options().device_run and Options(device="cuda:1").device_run


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
@pytest.mark.parametrize("command", ["verify", "bench"])
def test_device_cuda_without_cuda_is_a_one_line_error(command):
    proc = subprocess.run([sys.executable, "-m", "qkvfuse", command, "--device", "cuda"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0] and lines[0].startswith(f"{command}: --device cuda")


def test_bad_device_string_and_conflicting_flags(capsys):
    assert main(["verify", "--device", "gpu0"]) == 2
    assert "not a torch device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["verify", "--device", "cuda", "--cpu-interpreter"])


def test_section_not_of_this_run_is_an_error(capsys):
    assert main(["verify", "--section", "conformance"]) == 2
    assert "not a section of this host run" in capsys.readouterr().out


def test_a_failing_or_crashing_section_fails_the_run_and_keeps_the_json(monkeypatch, tmp_path, capsys):
    def good(opts):
        return Section("good", ("check", "pass"), [{"check": "a", "pass": True}])

    def bad(opts):
        return Section("bad", ("check", "pass"), [{"check": "b", "pass": False, "detail": "wrong bits"}])

    def crash(opts):
        raise RuntimeError("kaput")

    fake = {"good": good, "bad": bad, "crash": crash}
    monkeypatch.setattr(sections, "REGISTRY", {n: sections.Entry(f"x:{n}", False, n) for n in fake})
    monkeypatch.setattr(sections, "load", lambda name: fake[name])
    path = tmp_path / "v.json"
    assert sections.run(Options(sections=["good"], json=str(path))) == 0
    assert sections.run(Options(json=str(path))) == 1
    out = capsys.readouterr().out
    assert "FAIL detail: wrong bits" in out and "RuntimeError: kaput" in out
    assert out.rstrip().splitlines()[-1].startswith("verify: 1 passed, 2 failed")
    result = json.loads(path.read_text())
    assert result["mode"] == "host" and [s["name"] for s in result["sections"]] == ["good", "bad", "crash"]


def test_triton_interpreter_refuses_once_triton_is_imported_without_it():
    """TRITON_INTERPRET must be on before triton is imported; later, the host sections report Triton as skipped
    and ``--cpu-interpreter`` stops, instead of failing at the first launch of half-interpreted kernels."""
    pytest.importorskip("triton")
    code = ("import sys, triton\n"
            "from qkvfuse._verify.sections import triton_interpreter\n"
            "print(repr(triton_interpreter()))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    late = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "imported before TRITON_INTERPRET=1" in late.stdout, late.stderr[-2000:]
    early = subprocess.run([sys.executable, "-c", code], env=dict(env, TRITON_INTERPRET="1"), capture_output=True,
                           text=True, timeout=300)
    assert early.stdout.strip() == "''", early.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------------------
# The unfused baseline of the gated Gemma models is their own transformers path, bit for bit.
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_gated_unfused_baseline_is_the_transformers_path(family):
    """``unfused_split`` of a gated Gemma case equals, in bf16, what transformers' attention does before attending:
    ``torch.chunk`` of ``q_proj``'s ``[q_h | gate_h]`` pairs, ``Qwen3NextRMSNorm`` / ``Qwen3_5RMSNorm`` (bf16 weights
    centred at 0), the model's rotary module (cos/sin cast to bf16; Qwen3.5: interleaved mRoPE from [3, T] image
    positions) and ``apply_rotary_pos_emb``; the gate is the chunk's second half."""
    transformers = pytest.importorskip("transformers")
    from qkvfuse._verify import SplitCase, make_split_inputs, unfused_split

    T, hq, hkv, D, max_pos = 6, 4, 2, 64, 256
    if family == "qwen3_next":
        from transformers.models.qwen3_next import modeling_qwen3_next as m

        cfg = transformers.Qwen3NextConfig(head_dim=D, hidden_size=256, num_attention_heads=hq, num_key_value_heads=hkv,
                                           rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                            "partial_rotary_factor": 0.25})
        rotary, norm_cls, sections = m.Qwen3NextRotaryEmbedding(cfg), m.Qwen3NextRMSNorm, None
    else:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m

        cfg = transformers.Qwen3_5TextConfig(head_dim=D, hidden_size=256, num_attention_heads=hq,
                                             num_key_value_heads=hkv,
                                             rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                              "partial_rotary_factor": 0.25,
                                                              "mrope_section": [3, 3, 2], "mrope_interleaved": True})
        rotary, norm_cls, sections = m.Qwen3_5TextRotaryEmbedding(cfg), m.Qwen3_5RMSNorm, (3, 3, 2)
    R = int(D * 0.25)
    case = SplitCase(T=T, num_q_heads=hq, num_kv_heads=hkv, head_dim=D, rotary_dim=R, dtype=torch.bfloat16,
                     weight_dtype=torch.bfloat16, q_gate=True, gemma_norm=True, mrope_section=sections,
                     mrope_interleaved=sections is not None, image=True, max_position=max_pos)
    kw = make_split_inputs(case, seed=7)
    # The table from the model's rotary module (fp32, 1-D positions): row p = [cos(p f) | sin(p f)].
    table_pos = torch.arange(max_pos)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), table_pos[None].expand(3, 1, -1) if sections else table_pos)
    kw["cos_sin_cache"] = torch.cat([cos[0, :, : R // 2], sin[0, :, : R // 2]], dim=-1)
    q_norm, k_norm = norm_cls(D, eps=kw["eps"]), norm_cls(D, eps=kw["eps"])
    with torch.no_grad():
        q_norm.weight.copy_(kw["q_weight"].float())
        k_norm.weight.copy_(kw["k_weight"].float())
    q_norm, k_norm = q_norm.to(torch.bfloat16), k_norm.to(torch.bfloat16)

    qkv, positions = kw["qkv"], kw["positions"]
    with torch.no_grad():
        q, gate = torch.chunk(qkv[None, :, : 2 * hq * D].view(1, T, hq, 2 * D), 2, dim=-1)
        k = qkv[None, :, 2 * hq * D : (2 * hq + hkv) * D].view(1, T, hkv, D)
        q, k = q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2)
        cos, sin = rotary(qkv[None], positions[:, None] if sections else positions[None])
        q, k = m.apply_rotary_pos_emb(q, k, cos, sin)
    want = (q.transpose(1, 2).reshape(T, -1), k.transpose(1, 2).reshape(T, -1), qkv[:, (2 * hq + hkv) * D :],
            gate.reshape(T, -1))
    got = unfused_split(**kw)
    for name, a, b in zip(("q", "k", "v", "gate"), got, want):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), name


# ---------------------------------------------------------------------------------------------------------------
# What the main job reads from a verify run: sections with their times, progress as the checks go, failures by
# name with the command that reruns them.
# ---------------------------------------------------------------------------------------------------------------
class _Recorder:
    def __init__(self):
        self.events = []

    def start(self, name, summary="", total=None):
        self.events.append(("start", name))

    def planned(self, n):
        self.events.append(("planned", n))

    def advance(self, n=1):
        self.events.append(("advance", n))

    def end(self, name="", section=None, seconds=None, line=""):
        self.events.append(("end", name, None if section is None else section.failures))


def test_collect_reports_progress_per_check_and_names_failures_with_a_rerun(monkeypatch, capsys):
    def checks(opts):
        sections.planned(3)
        for _ in range(3):
            sections.advance()
        return Section("checks", ("case", "backend", "max err", "pass"),
                       [{"case": "Qwen3-8B T=1", "backend": "cpu", "max err": 0.1, "pass": True},
                        {"case": "GLM-4.5 T=33", "backend": "cpu", "max err": 9.0, "pass": False, "detail": "too far"},
                        {"case": "any", "backend": "triton", "pass": None}])

    monkeypatch.setattr(sections, "REGISTRY", {"checks": sections.Entry("x:checks", False, "checks")})
    monkeypatch.setattr(sections, "load", lambda name: checks)
    recorder = _Recorder()
    done = sections.collect(Options(), progress=recorder)
    assert capsys.readouterr().out == ""  # collect prints nothing unless asked (echo)
    assert recorder.events == [("start", "checks"), ("planned", 3), ("advance", 1), ("advance", 1), ("advance", 1),
                               ("end", "checks", 1)]
    assert done.code == 1 and done.counts == {"passed": 1, "failed": 1, "skipped": 1}
    [(name, section, seconds)] = done.sections
    assert name == "checks" and seconds >= 0
    assert sections.failed_checks(name, section) == [
        {"name": "checks: GLM-4.5 T=33 cpu", "detail": "too far",
         "rerun": "python -m qkvfuse verify --section checks --backend cpu"}]
    sections.advance()  # outside a section: nothing to report to
    assert recorder.events[-1] == ("end", "checks", 1)


def test_rerun_commands():
    assert sections.rerun_command("ops", "triton") == "python -m qkvfuse verify --section ops --backend triton"
    assert sections.rerun_command("models") == "python -m qkvfuse verify --section models"
    assert sections.rerun_command("backends", "cpu") == "python -m qkvfuse verify --backend cpu"
