"""GLM-4 MoE block patched for shared-expert overlap: bitwise equal to transformers, on CPU, fp32 and bf16.

A tiny GLM-4.7 is built from ``Glm4MoeConfig`` (head_dim 128, partial rotary 0.5, QK-norm, qkv bias, sigmoid
router with scale 2.5; tiny hidden size and expert count). Every comparison is bit-for-bit; each starts from
showing that two sequential runs of the unpatched module already agree bitwise, so a mismatch could only come
from the patch.
"""

import copy
import functools
import threading

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _support.moe_stream_fakes import (Call, FakeDeviceModule, intercepting_record_stream, protocol_violations,
                                       recording)
from qkvfuse.moe import ENV_VAR, SharedExpertOverlap, is_glm4_moe_block, patch_glm4_moe, unpatch_glm4_moe

DTYPES = [torch.float32, torch.bfloat16]


def tiny_glm47_config(experts_implementation="grouped_mm"):
    return transformers.Glm4MoeConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        partial_rotary_factor=0.5, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        use_qk_norm=True, attention_bias=True, rms_norm_eps=1e-5, max_position_embeddings=64,
        experts_implementation=experts_implementation,
    )


@functools.lru_cache(maxsize=None)
def _model(dtype, experts_implementation="grouped_mm"):
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_glm47_config(experts_implementation), dtype=dtype)  # dtype at construction: router stays as loaded
    with torch.no_grad():
        for block in _blocks(model):
            # A non-zero correction bias changes which experts win, as in the published checkpoints.
            block.gate.e_score_correction_bias.normal_(0.0, 0.05)
    return model.eval()


def _blocks(model):
    return [m for m in model.modules() if is_glm4_moe_block(m)]


@pytest.fixture
def model_factory():
    """Tiny GLM-4.7 models, always handed out unpatched."""
    used = []

    def get(dtype, experts_implementation="grouped_mm"):
        model = _model(dtype, experts_implementation)
        used.append(model)
        return model

    yield get
    for model in used:
        for block in _blocks(model):
            unpatch_glm4_moe(block)


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bitwise(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.isfinite(a).all()
    assert torch.equal(_bits(a), _bits(b)), f"max |diff| {(a.float() - b.float()).abs().max().item()}"


def _fake_runner():
    fake = FakeDeviceModule()
    return fake, SharedExpertOverlap(enabled=True, device_module=fake)


@pytest.mark.parametrize("experts_implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (2, 5)], ids=["decode", "prefill"])
def test_block_bitwise_on_off_and_original(model_factory, dtype, experts_implementation, shape):
    model = model_factory(dtype, experts_implementation)
    block = _blocks(model)[0]
    assert type(block).__name__ == "Glm4MoeMoE"
    x = torch.randn(*shape, 64, dtype=dtype)
    with torch.no_grad():
        original = block(x)
        assert_bitwise(block(x), original)  # sequential runs agree: the baseline for every comparison below
        assert original.abs().max() > 0
        for overlap in (False, True):  # True on CPU tensors: the real helper, inline
            patch_glm4_moe(block, overlap=overlap)
            assert_bitwise(block(x), original)
        fake, runner = _fake_runner()  # the stream path, with fake streams
        patch_glm4_moe(block, overlap=True, runner=runner)
        with intercepting_record_stream(fake):
            assert_bitwise(block(x), original)
        assert ("wait", "main", "side0") in fake.log
        assert unpatch_glm4_moe(block) is True and unpatch_glm4_moe(block) is False
        assert "forward" not in block.__dict__
        assert_bitwise(block(x), original)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_stream_protocol(model_factory, dtype):
    """The patched GLM-4 block keeps the protocol: router and routed experts on main, shared expert on the
    side stream, its output read only after the join, the sum allocated on main."""
    block = _blocks(model_factory(dtype))[0]
    fake, runner = _fake_runner()
    patch_glm4_moe(block, overlap=True, runner=runner)
    captured = {}
    handle = block.shared_experts.register_forward_hook(lambda mod, args, out: captured.setdefault("out", out))
    x = torch.randn(2, 3, 64, dtype=dtype)
    try:
        with torch.no_grad(), recording(fake):
            out = block(x)
    finally:
        handle.remove()
    assert protocol_violations(fake.log, Call(x, captured["out"], out)) == []
    side_ops = {e[1] for e in fake.log if e[0] == "op" and e[2] == "side0"}
    assert "linear" in side_ops and "silu" in side_ops  # the shared MLP, nothing else, ran on the side
    main_ops = {e[1] for e in fake.log if e[0] == "op" and e[2] == "main"}
    assert "sigmoid" in main_ops and "topk" in main_ops  # the router stayed on main


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tiny_glm47_model_bitwise(model_factory, dtype):
    model = model_factory(dtype)
    assert model.dtype == dtype and len(_blocks(model)) == 2
    ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        ref = model(ids, output_router_logits=True)
        again = model(ids, output_router_logits=True)
        assert_bitwise(again.logits, ref.logits)
        fake, runner = _fake_runner()
        for kwargs in ({"overlap": False}, {"overlap": True}, {"overlap": True, "runner": runner}):
            for block in _blocks(model):
                patch_glm4_moe(block, **kwargs)
            with intercepting_record_stream(fake):
                out = model(ids, output_router_logits=True)
            assert_bitwise(out.logits, ref.logits)
            # The router is still called as a module, so transformers' router-logit recorder still sees it.
            assert len(out.router_logits) == len(ref.router_logits) == 2
            for a, b in zip(out.router_logits, ref.router_logits):
                assert_bitwise(a, b)
    assert sum(e[:2] == ("wait", "main") for e in fake.log) == 2  # one join per MoE layer


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tiny_glm47_model_concurrent_threads(model_factory, dtype):
    """Several threads run the patched model at once (fake streams are per thread, like CUDA's current stream;
    the side stream is shared); every result equals the sequential one bit for bit."""
    model = model_factory(dtype)
    inputs = [torch.randint(0, 96, (1 + i % 2, 3 + i)) for i in range(4)]
    with torch.no_grad():
        sequential = [model(ids).logits for ids in inputs]
        for ids, ref in zip(inputs, sequential):  # sequential runs are reproducible before any threading
            assert_bitwise(model(ids).logits, ref)
    fake, runner = _fake_runner()
    for block in _blocks(model):
        patch_glm4_moe(block, overlap=True, runner=runner)
    results, errors = {}, []
    barrier = threading.Barrier(len(inputs))

    def worker(i):
        try:
            barrier.wait()
            with torch.no_grad():
                results[i] = [model(inputs[i]).logits for _ in range(2)]
        except Exception as exc:  # reported below; a thread cannot fail the test by itself
            errors.append(exc)

    with intercepting_record_stream(fake):
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(inputs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    for i, ref in enumerate(sequential):
        for out in results[i]:
            assert_bitwise(out, ref)
    assert len(fake.created) == 1  # one side stream for all layers and threads
    assert sum(e[:2] == ("wait", "main") for e in fake.log) == 2 * 2 * len(inputs)


def test_environment_switch_and_patch_api(model_factory, monkeypatch):
    model = model_factory(torch.float32)
    block = _blocks(model)[0]
    keys = set(model.state_dict())
    monkeypatch.setenv(ENV_VAR, "1")
    patch_glm4_moe(block)  # overlap=None reads the environment at patch time
    assert block.__dict__["_qkvfuse_shared_expert_overlap"].enabled is True
    patch_glm4_moe(block, overlap=False)  # re-patching replaces the setting; the argument wins
    assert block.__dict__["_qkvfuse_shared_expert_overlap"].enabled is False
    monkeypatch.delenv(ENV_VAR)
    patch_glm4_moe(block)
    assert block.__dict__["_qkvfuse_shared_expert_overlap"].enabled is False
    assert set(model.state_dict()) == keys  # the helper is no submodule and holds no weights
    clone = copy.deepcopy(model)  # a patched model can still be copied; the copy runs its own weights
    x = torch.randn(1, 4, 64)
    with torch.no_grad():
        assert_bitwise(_blocks(clone)[0](x), block(x))
    assert _blocks(clone)[0].forward.__self__ is _blocks(clone)[0]
    with pytest.raises(TypeError, match="GLM-4 MoE blocks"):
        patch_glm4_moe(block.shared_experts, overlap=True)
    with pytest.raises(TypeError, match="runner must be a SharedExpertOverlap"):
        patch_glm4_moe(block, overlap=True, runner="side")


@pytest.mark.parametrize("module_name, block_name, config_name", [
    ("glm4v_moe", "Glm4vMoeTextMoE", "Glm4vMoeTextConfig"),  # GLM-4.5V text model
    ("glm4_moe_lite", "Glm4MoeLiteMoE", "Glm4MoeLiteConfig"),
])
def test_twin_blocks_patch_bitwise(module_name, block_name, config_name):
    """The other transformers classes accepted by patch_glm4_moe have the same forward; it stays bitwise."""
    import importlib

    block_cls = getattr(importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}"),
                        block_name)
    config = getattr(transformers, config_name)(
        hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
        topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, experts_implementation="grouped_mm")
    block = block_cls(config).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.1)
        block.gate.e_score_correction_bias.normal_(0.0, 0.05)
    x = torch.randn(2, 3, 64)
    fake, runner = _fake_runner()
    with torch.no_grad():
        original = block(x)
        assert_bitwise(block(x), original)
        patch_glm4_moe(block, overlap=True, runner=runner)
        with intercepting_record_stream(fake):
            assert_bitwise(block(x), original)
        unpatch_glm4_moe(block)
    assert ("wait", "main", "side0") in fake.log


@pytest.mark.parametrize("overlap", ["off", "on", "fake streams"])
def test_patched_block_traces_fullgraph(overlap):
    """The patched forward adds no graph break (GLM-4 MoE models declare full-graph compilability): under
    torch.compile the helper takes the inline path, even with a stream module at hand."""
    # A fresh model: once a model ran with output_router_logits=True, transformers' output-recording hooks sit
    # on the router and Dynamo cannot trace them (ContextVar.get), patched or not.
    block = _blocks(_model.__wrapped__(torch.float32))[0]
    x = torch.randn(2, 3, 64)
    fake, runner = _fake_runner()
    torch._dynamo.reset()
    with torch.no_grad():
        original = block(x)
        patch_glm4_moe(block, overlap=overlap != "off", runner=runner if overlap == "fake streams" else None)
        assert_bitwise(torch.compile(block, backend="eager", fullgraph=True)(x), original)
    assert fake.log == []
