"""The fake vLLM (:class:`tests.support.faultkit.ToughFake`) in a process of its own.

A load test must not share one interpreter (and its GIL) between 1,000 clients and the upstream
they load: a real vLLM is a process of its own too. Counters are at ``GET /_fake/stats``.

    with FakeProcess(model_dir, max_model_len=32768, num_gpu_blocks=200_000) as fake:
        httpx.get(fake.url + "/_fake/stats").json()
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from harness.fake_vllm import FakeServer

ROOT = Path(__file__).resolve().parents[2]


class FakeProcess:
    """``python -m tests.support.fake_process`` on a free port; stopped with SIGTERM."""

    def __init__(self, model_dir: Path, **knobs: Any) -> None:
        self.model_dir = model_dir
        self.knobs = knobs
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict[str, Any]:
        return dict(httpx.get(self.url + "/_fake/stats", timeout=30).json())

    def start(self) -> FakeProcess:
        cmd = [sys.executable, "-m", "tests.support.fake_process", str(self.model_dir)]
        cmd += ["--knobs", json.dumps(self.knobs)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fake process exited with {self.proc.wait()}")
        self.port = int(line)
        deadline = time.monotonic() + 10
        while True:
            try:
                httpx.get(self.url + "/health", timeout=2)
                return self
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the fake process does not answer"
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> FakeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    from tests.support.faultkit import ToughFake

    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--knobs", default="{}")
    args = parser.parse_args()
    knobs = json.loads(args.knobs)
    app = ToughFake(model_root=args.model_dir, max_model_len=knobs.pop("max_model_len", 1024))
    for name, value in knobs.items():
        assert hasattr(app, name), name
        setattr(app, name, value)
    server = FakeServer(app).start()
    print(server.port, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
