"""``python -m sidecar`` is ``kv-sidecar``."""

from sidecar.cli import main

raise SystemExit(main())
