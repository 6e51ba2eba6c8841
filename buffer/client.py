"""Moved to ``buffer.trainer.client``; this import path stays for code written against it."""

from buffer.trainer.client import *  # noqa: F403
from buffer.trainer.client import __all__ as __all__
