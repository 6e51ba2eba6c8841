"""rollout-buffer: a standalone rollout buffer for agentic RL training of LLMs."""

__version__ = "0.1.0"
