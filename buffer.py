"""Start the rollout buffer, as with slime's: ``python buffer.py`` (``--help`` for options)."""

from buffer.cli import main

if __name__ == "__main__":
    main()
