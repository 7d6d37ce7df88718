"""A simulated-GPU vLLM (``python -m harness.sim_vllm``) as a process, for tests and benchmarks.

Standard library only, so the project's venv and the vLLM venv can both import it.

    with SimServer(model="llama-3.1-8b-instruct", gpu="h100-80gb") as sim:
        sim.set_mode("manual")
        ...  # send a request
        sim.wait_waiting()
        sim.step(3)
        print(sim.state()["steps"])

The control channel is always on (a second free port): ``state()``, ``step(n)``,
``set_mode(m)``; see ``harness.sim_executor``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.local import log_tail, stop_group, wait_healthy
from harness.sim_vllm import MODELS, ROOT
from harness.vllm_cpu import CACHE, free_port, log, vllm_python


def model_config(name: str) -> Path:
    """A shipped config (``harness/models/NAME.json``) by name, or a path as given."""
    shipped = MODELS / f"{name}.json"
    return shipped if shipped.exists() else Path(name)


@dataclass
class SimServer:
    """vLLM's OpenAI server on a simulated GPU, on free loopback ports."""

    model: str = "llama-3.1-8b-instruct"
    gpu: str = "h100-80gb"
    step_mode: str = "roofline"
    max_model_len: int | None = 4096
    extra_args: list[str] = field(default_factory=list)
    startup_timeout: float = 180.0
    port: int = 0
    control_port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    #: seconds from the process start to a healthy /health
    startup_seconds: float | None = None
    #: where the executor appends its step trace (``KV_SIDECAR_SIM_TRACE``); None: no trace
    trace: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def control_url(self) -> str:
        return f"http://127.0.0.1:{self.control_port}"

    @property
    def served_name(self) -> str:
        return model_config(self.model).stem

    @property
    def model_dir(self) -> Path:
        """The directory it serves (config.json and tokenizer): what a sidecar in front reads."""
        from harness.sim_vllm import model_dir

        return model_dir(model_config(self.model))

    def command(self) -> list[str]:
        cmd = [
            str(vllm_python()),
            "-m",
            "harness.sim_vllm",
            "--gpu",
            self.gpu,
            "--model-config",
            str(model_config(self.model)),
            "--sim-step",
            self.step_mode,
            "--sim-control",
            f"127.0.0.1:{self.control_port}",
            "--port",
            str(self.port),
        ]
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        return cmd + self.extra_args

    def start(self) -> SimServer:
        from harness.vllm_cpu import VENV, ensure_vllm

        if not (VENV / ".ok").exists():  # ensure_vllm() probes the import: seconds, every time
            ensure_vllm()
        self.port = self.port or free_port()
        self.control_port = self.control_port or free_port()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        if self.trace is not None:
            env["KV_SIDECAR_SIM_TRACE"] = str(self.trace)
        logs = CACHE / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.log_path = logs / f"sim-vllm-{self.port}.log"
        log(f"starting simulated vLLM ({self.model} on {self.gpu}) on {self.url}")
        started = time.monotonic()
        with open(self.log_path, "wb") as fh:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )
        self._wait_healthy()
        self.startup_seconds = time.monotonic() - started
        log(f"simulated vLLM healthy on {self.url} after {self.startup_seconds:.1f} s")
        return self

    def _wait_healthy(self) -> None:
        try:
            wait_healthy(self.url, self.proc, self.startup_timeout, "simulated vLLM", self.log_path)
        except TimeoutError:
            self.stop()
            raise

    def log_tail(self, n: int = 40) -> str:
        return log_tail(self.log_path, n)

    def stop(self) -> None:
        stop_group(self.proc)

    # --- the control channel ---

    def _control(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.control_url + path,
            data=data,
            method=method,
            headers={"content-type": "application/json"},
        )
        timeout = 10.0 + float((body or {}).get("timeout", 0))
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def state(self) -> dict[str, Any]:
        return dict(self._control("GET", "/state"))

    def set_mode(self, mode: str) -> dict[str, Any]:
        """``roofline``, ``manual`` or a fixed step time in seconds (as a string)."""
        return dict(self._control("POST", "/mode", {"mode": mode}))

    def step(self, n: int = 1, timeout: float = 30.0) -> dict[str, Any]:
        """Grant ``n`` steps (manual mode) and wait until they have run."""
        answer = dict(self._control("POST", "/step", {"n": n, "timeout": timeout}))
        if not answer.get("done"):
            raise TimeoutError(f"{n} steps did not run within {timeout} s: {answer}")
        return answer

    def wait_waiting(self, timeout: float = 30.0) -> dict[str, Any]:
        """Wait until a scheduled batch waits for its grant (manual mode)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state()
            if state["waiting"]:
                return state
            time.sleep(0.01)
        raise TimeoutError(f"no batch waited for a grant within {timeout} s")

    def __enter__(self) -> SimServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":  # pragma: no cover - manual use
    with SimServer(*sys.argv[1:2]) as server:
        print(server.url, server.control_url, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while server.proc is not None and server.proc.poll() is None:
                time.sleep(1)
