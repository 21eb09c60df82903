"""vLLM integration tests: run by ``make test-vllm`` in the vLLM venv (tests/integrations/conftest.py leaves this
folder out where vLLM is not installed)."""

import os

import pytest

from _support.vllm_engine import OFFLINE_ENV

os.environ.update(OFFLINE_ENV)  # before vLLM is imported


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """``tiny_dir(name)``: a saved tiny random-weight checkpoint of model ``name`` (built once per session)."""
    from _support.vllm_engine import save_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return lambda name: save_tiny_model(name, str(root / name))
