"""``python -m bench.owner_loop``."""

from bench.owner_loop.cli import main

if __name__ == "__main__":
    main()
