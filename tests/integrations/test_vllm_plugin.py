"""The vLLM plugin's vLLM-free parts, in the default suite: the entry point without vLLM, and the options."""

import sys

import pytest

from qkvfuse.integrations import vllm as plugin


def test_register_is_cheap_idempotent_and_imports_nothing_of_vllm(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    before = set(sys.modules)
    plugin.register()
    plugin.register()
    from qkvfuse.integrations import _engine_common

    assert plugin._LOADER_MODULE in _engine_common.pending_imports()
    assert _engine_common._callbacks[plugin._LOADER_MODULE].count(plugin._wrap_loader) == 1  # however often
    assert not any(name == "vllm" or name.startswith("vllm.") for name in set(sys.modules) - before)


def test_options_default_off_and_parse_the_config(monkeypatch):
    monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    assert not plugin.options_from_config({}).enabled
    assert not plugin.options_from_config(None).enabled
    assert plugin.options_from_config({"qkvfuse": True}) == plugin.Options(attention=True)
    opts = plugin.options_from_config({"qkvfuse": {"attention": True, "add_rmsnorm": True, "backend": "cpu"}})
    assert opts == plugin.Options(attention=True, add_rmsnorm=True, backend="cpu")
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    assert plugin.options_from_config({}) == plugin.Options(attention=True)
    assert not plugin.options_from_config({"qkvfuse": {"attention": False}}).enabled  # the config entry wins


def test_kv_cache_is_on_with_attention_unless_set_false(monkeypatch):
    monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    assert plugin.options_from_config({"qkvfuse": {"attention": True}}).kv_cache
    assert plugin.options_from_config({"qkvfuse": True}).kv_cache
    opts = plugin.options_from_config({"qkvfuse": {"attention": True, "kv_cache": False}})
    assert opts == plugin.Options(attention=True, kv_cache=False) and opts.enabled
    assert not plugin.options_from_config({"qkvfuse": {"kv_cache": True}}).enabled  # nothing without attention
    with pytest.raises(ValueError, match=r"\['kv_cache'\]: expected a bool, got 'no'"):
        plugin.options_from_config({"qkvfuse": {"attention": True, "kv_cache": "no"}})


def test_the_kv_cache_guard_has_a_tested_hash_per_function():
    """Every function the kv_cache option reproduces or replaces has tested hashes (the engine suite checks them
    against the installed vLLM)."""
    assert plugin._KV_CACHE_SOURCES and all(plugin.TESTED_SOURCES.get(name) for name in plugin._KV_CACHE_SOURCES)


@pytest.mark.parametrize("entry, match", [({"atention": True}, "unknown key 'atention'"),
                                          ({"attention": "yes"}, r"\['attention'\]: expected a bool"),
                                          ("on", "expected a dict")])
def test_bad_options_name_the_key(entry, match):
    with pytest.raises(ValueError, match=match):
        plugin.options_from_config({"qkvfuse": entry})


@pytest.mark.parametrize("entry", [{"backend": "bogus"}, {"attention": False, "backend": "bogus"},
                                   {"attention": True, "backend": "CPU"}])
def test_a_bad_backend_is_refused_with_every_feature_off(monkeypatch, entry):
    """The backend is checked by the options' one rule, not when a layer binds: a misspelt value stops the engine
    even when no feature would have used it (the model walk parses the options first)."""
    import types

    monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    with pytest.raises(ValueError, match=r"additional_config\['qkvfuse'\]\['backend'\]: expected one of .* got"):
        plugin.options_from_config({"qkvfuse": entry})
    with pytest.raises(ValueError, match=r"\['backend'\]"):
        plugin.fuse_model(types.SimpleNamespace(modules=lambda: []),
                          types.SimpleNamespace(additional_config={"qkvfuse": entry}))


@pytest.mark.parametrize("backend", [None, "auto", "reference", "cpu", "triton"])
def test_every_backend_name_is_accepted(backend):
    assert plugin.options_from_config({"qkvfuse": {"backend": backend}}).backend == backend


def test_tested_sources_says_which_engines_are_missing(capsys, monkeypatch):
    """``python -m qkvfuse.integrations.tested_sources`` where an engine is not installed says so (the engine
    suites check its table where the engine is)."""
    from qkvfuse.integrations import tested_sources

    monkeypatch.setattr(tested_sources, "_installed", lambda distributions: None)
    assert tested_sources.main(["--check"]) == 0
    assert capsys.readouterr().out.splitlines() == ["vLLM: not installed", "SGLang: not installed"]
