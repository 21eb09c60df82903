"""The SGLang plugin's GLM-4.x shared-expert overlap on SGLang's own ``Glm4MoeSparseMoeBlock``.

The block is built directly (no engine) with random weights. On CPU the overlapped ``forward_normal`` runs inline
and must give SGLang's bits; with the recording fake device module of ``tests/_support/moe_stream_fakes.py`` the
same block runs the stream protocol (fork, record, shared expert on the side stream, routed experts on main, join,
record, sum on main), which is checked rule by rule -- the ordering a GPU run depends on, proven here without one.
"""

import pytest
import torch

from _support.moe_stream_fakes import Call, FakeDeviceModule, protocol_violations, recording
from qkvfuse.integrations import sglang as plugin
from qkvfuse.moe import SharedExpertOverlap

HIDDEN = 64


@pytest.fixture(scope="module")
def moe_block(sglang_dist):
    """``block(dtype)``: a fresh SGLang GLM-4 MoE block (4 routed experts, 1 shared) with random weights."""
    from sglang.srt.models.glm4_moe import Glm4MoeSparseMoeBlock
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from transformers import Glm4MoeConfig

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", device="cpu"))
    config = Glm4MoeConfig(hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4,
                           n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                           routed_scaling_factor=2.5, norm_topk_prob=True, hidden_act="silu",
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16)

    def build(dtype=torch.float32):
        block = Glm4MoeSparseMoeBlock(config, layer_id=1, prefix="model.layers.1.mlp")
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        block.to(dtype)
        block.gate.float()  # SGLang keeps the router in fp32 (Glm4MoeGate upcasts its input)
        return block.eval()

    return build


def _inputs(dtype):
    return torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inline_on_cpu_is_sglangs_bits(moe_block, dtype):
    block = moe_block(dtype)
    x = _inputs(dtype)
    with torch.no_grad():
        expected = block.forward(x)
        report = plugin.fuse_moe(block)
        assert "forward_normal" in block.__dict__ and report.lines() and "fused 1/1" in report.lines()[0]
        got = block.forward(x)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stream_protocol_on_the_fake_device(moe_block, dtype):
    """Shared expert on the side stream, router and routed experts on main, the sum on main after the join; the
    result bitwise SGLang's."""
    block = moe_block(dtype)
    x = _inputs(dtype)
    with torch.no_grad():
        expected = block.forward(x)
    fake = FakeDeviceModule()
    plugin.fuse_moe(block, runner=SharedExpertOverlap(enabled=True, device_module=fake))
    captured = {}
    handle = block.shared_experts.register_forward_hook(lambda mod, args, out: captured.setdefault("out", out))
    try:
        with torch.no_grad(), recording(fake):
            out = block.forward(x)
    finally:
        handle.remove()
    assert protocol_violations(fake.log, Call(x, captured["out"], out)) == []
    assert torch.equal(out, expected)
    side = {e[1] for e in fake.log if e[0] == "op" and e[2] != "main"}
    main = {e[1] for e in fake.log if e[0] == "op" and e[2] == "main"}
    assert "linear" in side  # the shared MLP ran on the side stream
    assert main - side  # the router / routed experts stayed on main


def test_refusals_and_options(moe_block, monkeypatch):
    block = moe_block()
    block.num_fused_shared_experts = 1
    report = plugin.fuse_moe(block)
    assert "forward_normal" not in block.__dict__ and "no separate shared expert" in "\n".join(report.lines())
    untested = plugin.fuse_moe(moe_block(), untested="Glm4MoeSparseMoeBlock.forward_normal is untested")
    assert "untested" in "\n".join(untested.lines())
    # Through the model walk: only when asked, and an untested source hash leaves the block to SGLang.
    model = torch.nn.Sequential(moe_block())
    plugin.fuse_model(model, plugin.options_from_env('{"attention": true}'))
    assert "forward_normal" not in model[0].__dict__
    assert plugin.options_from_env('{"shared_expert_overlap": true}').enabled
    with pytest.raises(ValueError, match="shared_expert_overlap"):
        plugin.options_from_env('{"shared_expert_overlap": 1}')
    monkeypatch.setitem(plugin.TESTED_SOURCES, "Glm4MoeSparseMoeBlock.forward_normal", ("0" * 16,))
    report = plugin.fuse_model(model, plugin.options_from_env('{"shared_expert_overlap": true}'))
    assert "forward_normal" not in model[0].__dict__ and any("forward_normal" in line for line in report.lines())
    monkeypatch.undo()
    plugin.fuse_model(model, plugin.options_from_env('{"shared_expert_overlap": true}'))
    assert "forward_normal" in model[0].__dict__
