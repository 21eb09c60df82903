"""The SGLang plugin's SGLang-free parts, in the default suite: the entry point without SGLang, the options, and
the import hook it is built on."""

import sys
import types

import pytest

from qkvfuse.integrations import _engine_common
from qkvfuse.integrations import sglang as plugin


def test_register_is_cheap_idempotent_and_imports_nothing_of_sglang(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(_engine_common, "_callbacks", {})
    before = set(sys.modules)
    plugin.register()
    plugin.register()
    assert sum(isinstance(f, _engine_common._ImportHook) for f in sys.meta_path) == 1
    assert _engine_common.pending_imports() == [plugin._RUNNER_MODULE]
    assert len(_engine_common._callbacks[plugin._RUNNER_MODULE]) == 1
    assert not any(name == "sglang" or name.startswith("sglang.") for name in set(sys.modules) - before)


def test_when_imported_runs_the_callback_after_the_module_executes(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(_engine_common, "_callbacks", {})
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "qkvfuse_probe_module.py").write_text("VALUE = 1\n")
    seen = []
    _engine_common.when_imported("qkvfuse_probe_module", lambda m: seen.append(m.VALUE))
    assert seen == []
    import qkvfuse_probe_module  # noqa: F401

    assert seen == [1] and _engine_common.pending_imports() == []
    assert not any(isinstance(f, _engine_common._ImportHook) for f in sys.meta_path)  # steps out when done
    _engine_common.when_imported("qkvfuse_probe_module", lambda m: seen.append(2))  # already imported: now
    assert seen == [1, 2]
    monkeypatch.delitem(sys.modules, "qkvfuse_probe_module")


def test_the_runner_wrapper_fuses_each_loaded_model(monkeypatch):
    """``ModelRunner.load_model`` / ``update_model_fields`` wrapped once: each model passes through fuse_model
    with the engine's context length."""
    seen = []
    monkeypatch.setattr(plugin, "fuse_model", lambda model, context_len=None: seen.append((model, context_len)))

    class ModelRunner:
        def load_model(self):
            self.model = "loaded"

        def update_model_fields(self, new_model, *, model_path):
            self.model = new_model

    module = types.SimpleNamespace(ModelRunner=ModelRunner)
    plugin._wrap_runner(module)
    plugin._wrap_runner(module)  # idempotent
    runner = ModelRunner()
    runner.model_config = types.SimpleNamespace(context_len=4096)
    runner.load_model()
    runner.update_model_fields("reloaded", model_path="x")
    assert seen == [("loaded", 4096), ("reloaded", 4096)] and runner.model == "reloaded"
    assert ModelRunner.load_model.__wrapped__.__name__ == "load_model"


def test_options_default_off_and_parse_the_environment(monkeypatch):
    monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    assert not plugin.options_from_env().enabled
    for off in ("", "0", " 0 ", "false"):
        assert not plugin.options_from_env(off).enabled
    assert plugin.options_from_env("1") == plugin.Options(attention=True)
    assert plugin.options_from_env("true") == plugin.Options(attention=True)
    opts = plugin.options_from_env('{"attention": true, "add_rmsnorm": true, "backend": "cpu", "verify": false}')
    assert opts == plugin.Options(attention=True, add_rmsnorm=True, backend="cpu")
    monkeypatch.setenv(plugin.ENV_VAR, '{"add_rmsnorm": true}')
    assert plugin.options_from_env() == plugin.Options(add_rmsnorm=True)


def test_plugin_off_changes_nothing(monkeypatch):
    monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    import torch

    model = torch.nn.Linear(2, 2)
    report = plugin.fuse_model(model)
    assert report.lines() == [] and "forward" not in model.__dict__


@pytest.mark.parametrize("value, match", [('{"atention": true}', "unknown key 'atention'"),
                                          ('{"attention": "yes"}', r"\['attention'\]: expected a bool"),
                                          ("on", "expected 1 or a JSON object"),
                                          ("[1]", "expected 1 or a JSON object")])
def test_bad_options_name_the_key(value, match):
    with pytest.raises(ValueError, match=match):
        plugin.options_from_env(value)


def test_kv_cache_is_on_with_attention_unless_set_false():
    assert plugin.options_from_env("1").kv_cache and plugin.options_from_env("1").attention
    assert plugin.options_from_env('{"attention": true}').kv_cache
    assert not plugin.options_from_env('{"attention": true, "kv_cache": false}').kv_cache
    assert not plugin.options_from_env('{"kv_cache": true}').enabled  # nothing to write from without attention
    with pytest.raises(ValueError, match=r"\['kv_cache'\]: expected a bool"):
        plugin.options_from_env('{"attention": true, "kv_cache": 1}')


def test_report_speaks_of_sglang():
    report = plugin.Report()
    report.count("Qwen3Attention", None, "cpu, rotary 128, neox")
    report.count("Qwen3Attention", "a reason")
    assert report.lines() == ["qkvfuse: fused 1/2 Qwen3Attention (cpu, rotary 128, neox)",
                              "qkvfuse: left 1/2 Qwen3Attention to SGLang: a reason"]


@pytest.mark.parametrize("value", ['{"backend": "bogus"}', '{"attention": false, "backend": "bogus"}',
                                   '{"attention": true, "backend": 3}'])
def test_a_bad_backend_is_refused_with_every_feature_off(monkeypatch, value):
    """``$QKVFUSE_SGLANG='{"backend": "bogus"}'`` stops the engine with a ValueError naming the key, even with every
    feature off: the model runner's wrapper parses the options before anything else."""
    import torch

    with pytest.raises(ValueError, match=r"\$QKVFUSE_SGLANG\['backend'\]: expected "):
        plugin.options_from_env(value)
    monkeypatch.setenv(plugin.ENV_VAR, value)
    with pytest.raises(ValueError, match=r"\['backend'\]"):
        plugin.fuse_model(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("backend", [None, "auto", "reference", "cpu", "triton"])
def test_every_backend_name_is_accepted(backend):
    import json

    assert plugin.options_from_env(json.dumps({"backend": backend})).backend == backend


def test_both_plugins_validate_options_with_one_rule():
    """The SGLang and vLLM plugins parse their options with the core's one function and word the same refusal."""
    from qkvfuse.integrations import vllm

    messages = []
    for parse in (lambda: plugin.options_from_env('{"backend": "bogus"}'),
                  lambda: vllm.options_from_config({"qkvfuse": {"backend": "bogus"}})):
        with pytest.raises(ValueError) as info:
            parse()
        messages.append(str(info.value).split("['backend']", 1)[1])
    assert messages[0] == messages[1]


def test_rebinding_compares_settings_by_value():
    """The engine core's re-binding key: tensors by identity and storage, modules by identity, the scalars a bound
    call uses (eps, rotary style, mRoPE section) by value -- an equal value is no change, an edited list is."""
    import torch

    from qkvfuse.integrations._rebind import Rebinding

    built = []
    binding = Rebinding(lambda *items: built.append(items) or len(built))
    weight, module, section = torch.ones(4), torch.nn.Identity(), [2, 1, 1]
    assert binding.get(weight, module, 1e-6, True, section) == 1
    assert binding.get(weight, module, float("1e-6"), True, list(section)) == 1  # equal values: no rebuild
    assert binding.get(weight, module, 0.5, True, section) == 2  # eps changed in place on the norm
    assert binding.get(weight, module, 0.5, False, section) == 3  # rotary style
    section[:] = [1, 2, 1]
    assert binding.get(weight, module, 0.5, False, section) == 4  # the engine's list edited in place
    assert binding.get(weight, torch.nn.Identity(), 0.5, False, section) == 5  # another module, same settings
    weight.data = torch.zeros(4)
    assert binding.get(weight, binding.items[1], 0.5, False, section) == 6  # new storage
