"""Edits of a live engine layer's settings, shared by the vLLM and SGLang layer suites.

Both engines' own forwards read a norm's ``variance_epsilon`` and the rotary module's settings on every call, so
a fused forward must follow an edit made in place (the module and its tensors stay the same objects).
"""


def set_eps(value, *names):
    """An edit that sets ``variance_epsilon`` of each named norm of the layer to ``value``."""
    def edit(layer):
        for name in names:
            getattr(layer, name).variance_epsilon = value
    return edit


def set_rotary(**settings):
    """An edit that sets attributes of the layer's rotary module (``is_neox_style``, ``mrope_interleaved``...)."""
    def edit(layer):
        for name, value in settings.items():
            setattr(layer.rotary_emb, name, value)
    return edit
