"""The stand-in for ``vllm._custom_ops.rotary_embedding`` (see the package docstring): raises if ever called."""


def rotary_embedding(*args, **kwargs):
    raise RuntimeError("tests/_support/sglang_stubs: vllm._custom_ops.rotary_embedding is a stand-in that SGLang "
                       "imports but must not call on the CPU base platform")
