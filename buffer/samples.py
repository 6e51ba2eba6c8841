"""Moved to ``buffer.trainer.samples``; this import path stays for code written against it."""

from buffer.trainer.samples import *  # noqa: F403
from buffer.trainer.samples import __all__ as __all__
