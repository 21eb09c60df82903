"""Not vLLM: a stand-in for the one vLLM import SGLang's base platform makes (tests only).

SGLang 0.5.23's ``RotaryEmbedding.__init__`` (``sglang/srt/layers/rotary_embedding/base.py``) stores
``vllm._custom_ops.rotary_embedding`` as a fallback kernel on platforms without one of its own -- the CPU base
platform the SGLang tests run on -- and never calls it there (the CPU path dispatches to ``forward_native``).
``make test-sglang`` puts this folder on ``PYTHONPATH`` so that import succeeds in the test process and in
SGLang's scheduler subprocesses. Nothing of it ships in the qkvfuse package.
"""
