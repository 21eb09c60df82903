"""SGLang integration tests: run by ``make test-sglang`` in the SGLang venv (tests/integrations/conftest.py leaves
this folder out where SGLang is not installed)."""

import os
import socket
import sys

import pytest

from _support.sglang_engine import OFFLINE_ENV, STUBS_DIR

os.environ.update(OFFLINE_ENV)
if STUBS_DIR not in sys.path:  # the stand-in for the one vllm import of SGLang's base platform (this process)
    sys.path.insert(0, STUBS_DIR)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def sglang_dist():
    """A world-1 process group and SGLang's model-parallel groups: SGLang's layers need them even at TP 1."""
    os.environ["MASTER_PORT"] = str(_free_port())
    from sglang.test.layer_ut_utils import init_single_process_dist

    init_single_process_dist(master_port=int(os.environ["MASTER_PORT"]))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """``tiny_dir(name)``: a saved tiny random-weight checkpoint of model ``name`` (built once per session)."""
    from _support.vllm_engine import save_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return lambda name: save_tiny_model(name, str(root / name))
