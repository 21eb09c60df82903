"""Test hooks inside every process of a test SGLang engine (tests only; see tests/_support/sglang_engine.py).

``$QKVFUSE_TEST_COUNTS``: count the SGLang plugin's fused calls and SGLang's own rotary forwards; each process
that makes one writes its counts to ``$QKVFUSE_TEST_COUNTS.<pid>`` after every call (SGLang ends its schedulers without running exit handlers).
``$QKVFUSE_TEST_KV_CHECK``: also check each of the plugin's KV-cache writes against SGLang's own writer on the same
K and V (``_support.sglang_kv_check``; counted as ``kv_*``).
``$QKVFUSE_TEST_UNTESTED``: pretend the named SGLang method hashes differently (the refusal tests).
"""

import os

if os.environ.get("QKVFUSE_TEST_COUNTS"):
    from qkvfuse.integrations import sglang as _counted  # its bound prepare / norm classes

    def _install(path=os.environ["QKVFUSE_TEST_COUNTS"]):
        import functools
        import json

        counts = {"attention": 0, "norm": 0, "rope": 0, "kv_writes": 0}
        prepare, prepare_cache = _counted._Prepare.__call__, _counted._Prepare.inplace_cache
        norm, kv_write = _counted._Norm.__call__, _counted._KVWrite.write

        def record(key, n=1):
            counts[key] = counts.get(key, 0) + n
            with open(f"{path}.{os.getpid()}", "w") as f:
                json.dump(counts, f)

        if os.environ.get("QKVFUSE_TEST_KV_CHECK"):
            from _support import sglang_kv_check

            sglang_kv_check.install(_counted, record)  # records kv_writes itself
        else:
            def counted_write(self, *args):
                out = kv_write(self, *args)
                if out is not None:
                    record("kv_writes")
                return out

            _counted._KVWrite.write = counted_write

        def counted_prepare(self, *args):
            record("attention")
            return prepare(self, *args)

        def counted_prepare_cache(self, *args):
            record("attention")
            return prepare_cache(self, *args)

        def counted_norm(self, *args):
            record("norm")
            return norm(self, *args)

        _counted._Prepare.__call__ = counted_prepare
        _counted._Prepare.inplace_cache = counted_prepare_cache
        _counted._Norm.__call__ = counted_norm

        def count_rope(module):  # SGLang's own rotary forwards, patched before any instance dispatches to them
            from sglang.srt.layers.rotary_embedding import mrope

            for cls in (module.RotaryEmbedding, mrope.MRotaryEmbedding):
                original = cls.forward_native

                # functools.wraps: the plugin's source hash reads through __wrapped__ (inspect.getsource
                # unwraps), so the counted method still hashes as SGLang's own
                @functools.wraps(original)
                def counted_rope(self, *args, _original=original, **kwargs):
                    record("rope")
                    return _original(self, *args, **kwargs)

                cls.forward_native = counted_rope

        from qkvfuse.integrations._engine_common import when_imported

        when_imported("sglang.srt.layers.rotary_embedding.base", count_rope)

    _install()

if os.environ.get("QKVFUSE_TEST_UNTESTED"):  # an SGLang whose named method hashes differently (refusal tests)
    from qkvfuse.integrations import sglang as _plugin

    _plugin.TESTED_SOURCES[os.environ["QKVFUSE_TEST_UNTESTED"]] = ("0" * 16,)
