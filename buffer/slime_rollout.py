"""Moved to ``buffer.trainer.slime_rollout``; this import path stays for code written against it.
slime configs name it: ``--rollout-function-path buffer.slime_rollout.generate_rollout``."""

from buffer.trainer.slime_rollout import *  # noqa: F403
from buffer.trainer.slime_rollout import __all__ as __all__
