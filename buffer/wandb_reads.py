"""Moved to ``buffer.trainer.wandb_reads``; this import path stays for code written against it."""

from buffer.trainer.wandb_reads import *  # noqa: F403
from buffer.trainer.wandb_reads import __all__ as __all__
