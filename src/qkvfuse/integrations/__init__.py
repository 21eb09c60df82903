"""Integrations of qkvfuse into model code.

* :mod:`qkvfuse.integrations.transformers` -- :func:`apply_qkvfuse` / :func:`remove_qkvfuse` patch a Hugging Face
  transformers model in place (Qwen3, Qwen3-MoE, Qwen3-VL, GLM-4.5/4.6/4.7, GLM-4.5V).

Nothing here is imported by ``import qkvfuse``; transformers is imported only when these modules are used. The
tiny test models and the ``models`` section of ``python -m qkvfuse verify`` live in :mod:`qkvfuse._verify`.
"""

__all__ = ["apply_qkvfuse", "remove_qkvfuse"]


def __getattr__(name):
    # Lazy, so that ``import qkvfuse.integrations`` does not import transformers.
    if name in __all__:
        from . import transformers as _hf

        return getattr(_hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
