import os

os.environ.setdefault("PYTHONUNBUFFERED", "1")

from bench.scaling.cli import main

main()
