"""rollout-buffer: a standalone rollout buffer for agentic RL training of LLMs."""

from importlib.metadata import PackageNotFoundError, version

try:  # one source for the version: pyproject.toml, as installed
    __version__ = version("rollout-buffer")
except PackageNotFoundError:  # a checkout on PYTHONPATH that was never installed
    __version__ = "0+unknown"
