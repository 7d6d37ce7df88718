"""Start vLLM's own OpenAI server on a simulated GPU: no model runs, the clock is a cost model.

    python -m harness.sim_vllm --gpu h100-80gb \\
        --model-config harness/models/llama-3.1-8b-instruct.json --port 8000 [vllm serve flags]

It runs ``vllm.entrypoints.openai.api_server`` (through ``harness.sim_api_server``, which keeps
chunked prefill and prefix caching on for MLA models whatever the host CPU; vLLM's CPU build,
from the project's cached venv: started with another python, it re-executes itself there) with
``--distributed-executor-backend harness.sim_executor.SimExecutor`` and the flags that make the
CPU build behave as vLLM does on the named GPU:

- ``--block-size 16`` (vLLM's CPU platform would pick 128; GPUs default to 16);
- ``--max-num-batched-tokens`` and ``--max-num-seqs`` at vLLM's defaults for that GPU (the CPU
  platform has its own, smaller ones);
- ``--load-format dummy``: there are no weights, and the executor never loads any;
- a model directory made once per config: the given ``config.json`` beside the project's
  generated tiny tokenizer (``harness.vllm_cpu.ensure_tokenizer_model``), since only token
  counts matter; served under the config file's name unless ``--served-model-name`` is given.

Every flag given here wins over those defaults. Its own flags:

    --gpu NAME            h100-80gb, h200-141gb, a100-80gb, a100-40gb, l40s-48gb, l4-24gb
                          (sidecar.kv.gpus, re-exported as harness.gpus)
    --model-config PATH   a config.json, or a directory holding one
    --sim-step MODE       roofline (default) | manual | SECONDS (a fixed step time)
    --sim-control H:P     the executor's control channel (GET /state, POST /step); manual needs it
    --sim-time-scale X    every step sleeps X times its cost (default 1: real time); for a host
                          CPU that cannot keep the GPU's pace (simulated_seconds stay GPU seconds)
    --sim-dry-run         print the KV pool vLLM would make for these flags (JSON) and exit

A request ends where its ``"vllm_xargs": {"sim_output_tokens": L}`` says (EOS as its L-th
token), else at ``max_tokens``; see ``harness.sim_executor``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from harness.gpus import gpu

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODELS = HERE / "models"
EXECUTOR = "harness.sim_executor.SimExecutor"
#: Tokenizer files copied from the tiny model's directory.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def _in_vllm_venv() -> bool:
    # find_spec, not an import: importing vllm costs seconds, and the server imports it anew
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _reexec_in_vllm_venv(argv: list[str]) -> None:
    from harness.vllm_cpu import ensure_vllm

    python = ensure_vllm()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    os.execve(str(python), [str(python), "-m", "harness.sim_vllm", *argv], env)


def model_dir(config_path: Path) -> Path:
    """A directory vLLM can serve: ``config_path``'s config.json and the tiny tokenizer."""
    from harness.vllm_cpu import CACHE, ensure_tokenizer_model

    if config_path.is_dir():
        config_path = config_path / "config.json"
    config_bytes = config_path.read_bytes()
    json.loads(config_bytes)  # fail here, not deep in vLLM, on a broken file
    tokenizer = ensure_tokenizer_model()
    key = config_bytes + str(tokenizer).encode() + repr(_TOKENIZER_FILES).encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    out = CACHE / "models" / f"sim-{config_path.stem}-{digest}"
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in _TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, tmp / name)
    (tmp / "config.json").write_bytes(config_bytes)
    try:
        tmp.rename(out)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def filler_token_id(directory: Path) -> int:
    """A plain word token of the tokenizer (" the"), emitted for every token but EOS."""
    try:
        vocab = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
    except (OSError, KeyError, ValueError):
        return 100
    for token in ("Ġthe", "the", "Ġa"):
        if token in vocab:
            return int(vocab[token])
    return 100


def _given(rest: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in rest for f in flags)


def sim_env(args: argparse.Namespace) -> dict[str, str]:
    """The simulated executor's settings from this command's own flags (its environment: the
    engine core inherits it)."""
    return {
        "KV_SIDECAR_SIM_GPU": gpu(args.gpu).name,
        "KV_SIDECAR_SIM_STEP": args.sim_step,
        "KV_SIDECAR_SIM_CONTROL": args.sim_control or "",
        "KV_SIDECAR_SIM_TIME_SCALE": repr(time_scale(args)),
    }


def time_scale(args: argparse.Namespace) -> float:
    """``--sim-time-scale``, else ``KV_SIDECAR_SIM_TIME_SCALE``, else 1."""
    from harness.sim_cost import ENV_TIME_SCALE, parse_time_scale

    if args.sim_time_scale is not None:
        return float(args.sim_time_scale)
    return parse_time_scale(os.environ.get(ENV_TIME_SCALE))


def build_command(args: argparse.Namespace, rest: list[str]) -> tuple[list[str], dict[str, str]]:
    """The vLLM command line and environment for ``args`` (own flags) and ``rest`` (vLLM's)."""
    spec = gpu(args.gpu)
    config = Path(args.model_config)
    directory = model_dir(config)
    cmd = [sys.executable, "-m", "harness.sim_api_server"]  # vLLM's server, as on a GPU host
    if not _given(rest, "--model"):
        cmd += ["--model", str(directory)]
    if not _given(rest, "--served-model-name"):
        cmd += ["--served-model-name", config.stem if config.is_file() else config.name]
    defaults: list[tuple[tuple[str, ...], list[str]]] = [
        (("--block-size",), ["--block-size", "16"]),
        (
            ("--max-num-batched-tokens",),
            ["--max-num-batched-tokens", str(spec.default_max_num_batched_tokens)],
        ),
        (("--max-num-seqs",), ["--max-num-seqs", str(spec.default_max_num_seqs)]),
        (("--load-format",), ["--load-format", "dummy"]),
        (("--host",), ["--host", "127.0.0.1"]),
    ]
    for flags, value in defaults:
        if not _given(rest, *flags):
            cmd += value
    cmd += ["--distributed-executor-backend", EXECUTOR, *rest]
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the CPU platform would size the pool from it
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **sim_env(args),
        KV_SIDECAR_SIM_TOKEN_ID=str(filler_token_id(directory)),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
    )
    return cmd, env


def dry_run(argv: list[str]) -> dict[str, object]:
    """The KV pool this command line would serve, sized by vLLM's own code, without serving.

    Builds vLLM's config from the same flags the server gets (``EngineArgs``, the CPU
    platform's checks), asks the simulated executor for its KV spec and memory, and lets
    vLLM's ``get_kv_cache_configs`` make the blocks: what the engine core does at startup, in
    a second or two after the import. Needs the vLLM venv.
    """
    args, rest = parser().parse_known_args(argv)
    cmd, env = build_command(args, rest)
    os.environ.update(env)
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    from harness.sim_api_server import as_gpu_host
    from harness.sim_executor import SimEngine

    as_gpu_host()

    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[3:])
    config = AsyncEngineArgs.from_cli_args(ns).create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER
    )
    engine = SimEngine(config)
    try:
        # the steps of EngineCore._initialize_kv_caches, in its order
        register_all_kvcache_specs(config)
        specs = engine.kv_cache_spec()
        resolve_kv_cache_layout(config, [["LBNHC"]], list(specs.values()))
        memory = engine.available_kv_cache_memory()
        (kv_config,) = get_kv_cache_configs(config, [specs], [memory])
    finally:
        engine.close()
    budget = engine.memory_budget()
    return {
        "gpu": engine.gpu.name,
        "tensor_parallel_size": engine.tp,
        "block_size": config.cache_config.block_size,
        "num_gpu_blocks": kv_config.num_blocks,
        "max_model_len": config.model_config.max_model_len,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "gpu_memory_utilization": config.cache_config.gpu_memory_utilization,
        "kv_cache_memory_bytes": memory,
        "weights_bytes": budget.weights_bytes,
        "non_kv_bytes": budget.non_kv_bytes,
    }


def _time_scale(value: str) -> float:
    from harness.sim_cost import parse_time_scale

    try:
        return parse_time_scale(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m harness.sim_vllm",
        description="vLLM's OpenAI server on a simulated GPU (other flags go to vLLM)",
    )
    p.add_argument("--gpu", default="h100-80gb", help="h100-80gb, h200-141gb, a100-80gb")
    p.add_argument("--model-config", required=True, help="config.json (or its directory)")
    p.add_argument("--sim-step", default="roofline", help="roofline | manual | SECONDS")
    p.add_argument("--sim-control", default="", help="HOST:PORT of the step control channel")
    p.add_argument(
        "--sim-time-scale",
        type=_time_scale,
        default=None,
        metavar="X",
        help="wall seconds per simulated second: every step sleeps X times its cost (default "
        "1, or KV_SIDECAR_SIM_TIME_SCALE); simulated_seconds stay in GPU seconds",
    )
    p.add_argument(
        "--sim-dry-run",
        action="store_true",
        help="print the KV pool vLLM would make (JSON) and exit, serving nothing",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, rest = parser().parse_known_args(argv)
    gpu(args.gpu)  # an unknown GPU fails before any re-exec
    if args.sim_step == "manual" and not args.sim_control:
        parser().error("--sim-step manual needs --sim-control HOST:PORT")
    try:
        time_scale(args)
    except ValueError as exc:
        parser().error(f"KV_SIDECAR_SIM_TIME_SCALE: {exc}")
    if not _in_vllm_venv():
        _reexec_in_vllm_venv(argv)
    if args.sim_dry_run:
        print(json.dumps(dry_run([a for a in argv if a != "--sim-dry-run"])))
        return 0
    cmd, env = build_command(args, rest)
    os.execve(cmd[0], cmd, env)
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
