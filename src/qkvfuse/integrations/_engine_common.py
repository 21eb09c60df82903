"""Engine-neutral pieces shared by the engine plugins (:mod:`.vllm`, :mod:`.sglang`; re-binding when a running
model changes is :mod:`._rebind`).

:func:`when_imported` runs a callback on a module right after Python executes it (or now, if it already has), so
an entry point that every engine process loads can patch one engine module without importing it where the
engine does not -- vLLM's front end never imports its model loader, SGLang's never imports its model runner.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Callable, Dict, List, Mapping, Optional, Sequence

__all__ = ["when_imported", "first_untested"]

_callbacks: Dict[str, List[Callable]] = {}


def when_imported(module_name: str, callback: Callable) -> None:
    """Call ``callback(module)`` once ``module_name`` has been executed: now if it is in ``sys.modules``, else
    right after its import (one finder in ``sys.meta_path`` for all pending modules; it steps out when none is
    left). The same callback registered twice for one module runs once."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return
    pending = _callbacks.setdefault(module_name, [])
    if callback not in pending:
        pending.append(callback)
    if not any(isinstance(f, _ImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportHook())


class _ImportHook(importlib.abc.MetaPathFinder):
    """Wraps the loader of each pending module so that its callbacks run right after it executes."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module
                callbacks = _callbacks.pop(fullname)

                def exec_and_call(module, exec_module=exec_module, callbacks=callbacks):
                    exec_module(module)
                    for callback in callbacks:
                        callback(module)

                spec.loader.exec_module = exec_and_call
                if not _callbacks and self in sys.meta_path:
                    sys.meta_path.remove(self)
                return spec
        return None


def pending_imports() -> List[str]:
    """The module names :func:`when_imported` still waits for (tests)."""
    return sorted(_callbacks)


def first_untested(names: Sequence[str], sources: Mapping[str, Callable], tested: Mapping[str, Sequence[str]],
                   hash_of: Callable[[Callable], str], engine: str, version: str) -> Optional[str]:
    """The reason a plugin leaves a layer to the engine when one of ``names`` (looked up in ``sources``: the
    engine's functions now) is missing or hashes (``hash_of``) to none of its ``tested`` versions; None when all
    are tested."""
    for name in names:
        fn = sources.get(name)
        if fn is None:
            return f"{name} not found in this {engine}"
        if hash_of(fn) not in tested[name]:
            return (f"{name} differs from the {engine} versions qkvfuse was tested with ({version}); its code is left "
                    "in place")
    return None
