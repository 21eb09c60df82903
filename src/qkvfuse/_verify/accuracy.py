"""The accuracy rule under its old name; it lives in :mod:`qkvfuse.testing.accuracy`."""

from ..testing.accuracy import *  # noqa: F401,F403
from ..testing.accuracy import __all__  # noqa: F401
