"""Start the rollout buffer, as with slime's: ``python buffer.py`` (``--help`` for options)."""

from buffer.service.cli import main

if __name__ == "__main__":
    main()
