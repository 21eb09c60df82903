"""Run a ``qkvfuse.testing`` catalogue in a child process, so a native crash is a reported failure.

The child prints one JSON record per line: ``{"start": name}`` before a call, then
``{"name", "ok", "detail"}`` after it; a call that started but never finished is the one that crashed.
"""

import json
import signal
import subprocess
import sys

import pytest

_CACHE = {}


def child_records(*module_args: str):
    """``(results by call name, exit code, call running when the child died, stderr tail)``, cached per args."""
    if module_args not in _CACHE:
        proc = subprocess.run([sys.executable, "-m", *module_args], capture_output=True, text=True, timeout=600)
        results, running = {}, None
        for line in proc.stdout.splitlines():
            record = json.loads(line)
            if "start" in record:
                running = record["start"]
            else:
                results[record["name"]] = (record["ok"], record["detail"])
                running = None
        _CACHE[module_args] = (results, proc.returncode, running, proc.stderr[-3000:])
    return _CACHE[module_args]


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def assert_child_call_ok(records, name: str) -> None:
    """Fail with the child's record for call ``name``, or with how and where the child died before it."""
    results, returncode, running, stderr = records
    if name not in results:
        where = f"while running {running!r}" if running else f"before reaching {name!r}"
        pytest.fail(f"the child process died ({describe_exit(returncode)}) {where}:\n{stderr}")
    ok, detail = results[name]
    assert ok, detail
