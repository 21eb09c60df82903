"""The float64 oracle and the unfused baseline under their old name; they live in :mod:`qkvfuse.testing.oracle`."""

from ..testing.oracle import *  # noqa: F401,F403
from ..testing.oracle import __all__  # noqa: F401
