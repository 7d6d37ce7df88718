"""`make demo`: what the sidecar computes for a real model before it is deployed.

Prints `kv-sidecar plan` for Qwen2.5-7B-Instruct on a 24 GB card (the proxy demo replaces this).
"""

from __future__ import annotations

from pathlib import Path

from sidecar.cli import main

CONFIG = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "configs"

if __name__ == "__main__":
    raise SystemExit(
        main(["plan", "--model-config", str(CONFIG / "qwen2.5-7b-instruct.json"),
              "--max-model-len", "8192", "--gpu-memory-gib", "24",
              "--gpu-memory-utilization", "1.0", "--weights-gib", "14"])
    )
