"""The ``kv-sidecar`` command: ``serve`` the proxy, ``plan`` capacity, ``status`` of a sidecar.

``plan`` is the offline capacity calculator; ``status`` reads a running sidecar's state from its
metrics port.

Errors end with one line on stderr (``kv-sidecar: error: ...``) and a non-zero exit, never a
traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sidecar import __version__
from sidecar.errors import ConfigError, one_line
from sidecar.kv.geometry import (
    DEFAULT_MAX_CONCURRENT_BATCHES,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    GIB,
    MODEL_DTYPE_BYTES,
    KVGeometry,
    ModelKV,
    derived_max_model_len_and_key,
    load_config,
    text_config,
)
from sidecar.kv.gpus import GPUS, GpuSpec, batch_defaults, gpu
from sidecar.kv.memory import (
    NON_TORCH_AND_CUDA_GRAPH_BYTES,
    ModelSize,
    activation_peak_bytes,
    memory_budget,
    model_weights,
)
from sidecar.kv.serving import (
    check_one_sequence_fits,
    check_tensor_parallel,
    resolve_max_model_len,
    serve_args,
    shell_line,
)

if TYPE_CHECKING:
    from pydantic import ValidationError

PROG = "kv-sidecar"


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def _model_dir(path: str) -> Path | None:
    """The model directory ``--model-config`` names (a directory, or its ``config.json``)."""
    p = Path(path)
    if p.is_dir():
        return p
    return p.parent if p.name == "config.json" else None


def _tokenizer_max_length(model_dir: Path | None) -> int | None:
    """``model_max_length`` from the model directory's ``tokenizer_config.json``, if any."""
    if model_dir is None:
        return None
    try:
        data = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = data.get("model_max_length") if isinstance(data, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _gpu_arg(name: str) -> GpuSpec:
    try:
        return gpu(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _gib_flag(value: float, flag: str) -> int:
    if not value >= 0:  # NaN too
        raise ConfigError(f"{flag} must not be negative, got {value}")
    return int(value * GIB)


def _allow_long() -> bool:
    """vLLM's ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` (``vllm/envs.py``: "1" or "true")."""
    return os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true")


def _budget(
    args: argparse.Namespace,
    config: dict[str, Any],
    model: ModelKV,
    model_dir: Path | None,
    total: int,
    batched_tokens: int,
    max_num_seqs: int,
) -> dict[str, Any]:
    """One rank's memory as vLLM's GPU worker finds it (see ``sidecar.kv.memory``)."""
    tp, pp = model.tensor_parallel_size, model.pipeline_parallel_size
    if args.weights_gib is not None:
        weights, weights_source = _gib_flag(args.weights_gib, "--weights-gib"), "--weights-gib"
    else:
        try:
            found = model_weights(config, model.model_dtype, model_dir)
        except ConfigError as exc:
            raise ConfigError(f"{exc}; pass --weights-gib") from None
        weights, weights_source = found.per_rank(tp, pp), found.source
    if args.overhead_gib is not None:
        activation, other = _gib_flag(args.overhead_gib, "--overhead-gib"), 0
        overhead_source = "--overhead-gib"
    else:
        try:
            size = ModelSize.from_config(config)
        except ConfigError as exc:
            raise ConfigError(f"{exc}; pass --overhead-gib") from None
        activation = activation_peak_bytes(
            mlp_width=size.mlp_width(tp),
            hidden=size.hidden,
            vocab=size.vocab,
            dtype_bytes=MODEL_DTYPE_BYTES[model.model_dtype],
            max_num_batched_tokens=batched_tokens,
            max_num_seqs=max_num_seqs,
        )
        other = NON_TORCH_AND_CUDA_GRAPH_BYTES
        overhead_source = "estimated"
    budget = memory_budget(
        total,
        args.gpu_memory_utilization,
        weights_bytes=weights,
        activation_bytes=activation,
        other_bytes=other,
    )
    if budget.kv_cache_bytes <= 0:
        raise ConfigError(
            f"no memory left for the KV cache: {_fmt_bytes(total)} x "
            f"{args.gpu_memory_utilization} = {_fmt_bytes(budget.requested_bytes)} requested, "
            f"less {_fmt_bytes(weights)} of weights per rank ({weights_source}) and "
            f"{_fmt_bytes(activation + other)} of activations and other memory "
            f"({overhead_source}): {_fmt_bytes(budget.kv_cache_bytes)}; vLLM refuses to start "
            "(No available memory for the cache blocks): add GPUs (-tp) or raise "
            "--gpu-memory-utilization"
        )
    return {
        "gpu_memory_bytes": total,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "requested_bytes": budget.requested_bytes,
        "weights_bytes": weights,
        "weights_source": weights_source,
        "activation_bytes": activation,
        "other_bytes": other,
        "overhead_source": overhead_source,
        "kv_cache_memory_bytes": budget.kv_cache_bytes,
    }


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """Compute the capacity figures for one model config (what ``kv-sidecar plan`` prints)."""
    config = load_config(args.model_config)
    model_dir = _model_dir(args.model_config)
    model = ModelKV.from_config(
        config,
        kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        dtype=args.dtype,
    )
    check_tensor_parallel(config, args.tensor_parallel_size)
    allow_long = _allow_long()
    max_model_len = resolve_max_model_len(
        config,
        args.max_model_len,
        tokenizer_model_max_length=_tokenizer_max_length(model_dir),
        allow_long=allow_long,
    )
    spec: GpuSpec | None = args.gpu
    total: int | None = None
    if spec is not None:
        total = spec.memory_bytes
        defaults = (spec.default_max_num_batched_tokens, spec.default_max_num_seqs)
    elif args.gpu_memory_gib is not None:
        if not args.gpu_memory_gib > 0:
            raise ConfigError(f"--gpu-memory-gib must be positive, got {args.gpu_memory_gib}")
        total = int(args.gpu_memory_gib * GIB)
        defaults = batch_defaults(total)
    else:
        defaults = (DEFAULT_MAX_NUM_BATCHED_TOKENS, 1024)
    batched_tokens = (
        defaults[0] if args.max_num_batched_tokens is None else args.max_num_batched_tokens
    )
    max_num_seqs = defaults[1] if args.max_num_seqs is None else args.max_num_seqs
    if batched_tokens <= 0 or max_num_seqs <= 0:
        raise ConfigError("--max-num-batched-tokens and --max-num-seqs must be positive")
    geo = KVGeometry.build(
        model,
        block_size=args.block_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=batched_tokens,
        max_concurrent_batches=args.max_concurrent_batches,
        mamba_cache_mode="align",  # a hybrid model's state under prefix caching, vLLM's default
    )
    out: dict[str, Any] = {
        "architecture": model.architecture,
        "model_type": model.model_type,
        "attention": model.attention,
        "layers_per_rank": model.num_layers,
        "kv_heads_per_rank": model.kv_heads_per_rank,
        "head_size": model.head_size,
        "sliding_windows": list(model.sliding_windows),
        "state_layers": model.state_layers,
        "attention_chunks": list(model.attention_chunks),
        "kv_cache_groups": len(geo.groups),
        "model_dtype": model.model_dtype,
        "kv_cache_dtype": model.kv_cache_dtype,
        "kv_element_bytes": model.dtype_bytes,
        "tensor_parallel_size": model.tensor_parallel_size,
        "pipeline_parallel_size": model.pipeline_parallel_size,
        "block_size": geo.block_size,
        "max_model_len": geo.max_model_len,
        "max_num_batched_tokens": batched_tokens,
        "max_num_seqs": max_num_seqs,
        "bytes_per_token": geo.bytes_per_token,
        "bytes_per_block": geo.bytes_per_block,
        "blocks_per_sequence": geo.blocks_per_sequence,
        "bytes_per_sequence": geo.bytes_per_sequence,
        "gpu": spec.name if spec else None,
    }
    memory: int | None = None
    if args.kv_cache_memory_gib is not None:
        if args.weights_gib is not None or args.overhead_gib is not None:
            raise ConfigError(
                "--weights-gib and --overhead-gib do not apply with --kv-cache-memory-gib "
                "(vLLM's --kv-cache-memory-bytes skips its memory profile)"
            )
        if not args.kv_cache_memory_gib > 0:
            raise ConfigError(
                f"--kv-cache-memory-gib must be positive, got {args.kv_cache_memory_gib}"
            )
        memory = int(args.kv_cache_memory_gib * GIB)
        out["kv_cache_memory_bytes"] = memory
    elif total is not None:
        out.update(_budget(args, config, model, model_dir, total, batched_tokens, max_num_seqs))
        memory = out["kv_cache_memory_bytes"]
    elif args.weights_gib is not None or args.overhead_gib is not None:
        raise ConfigError("--weights-gib and --overhead-gib need --gpu or --gpu-memory-gib")
    if memory is not None:
        check_one_sequence_fits(geo, memory)
        num_blocks = geo.num_blocks(memory)
        out.update(
            num_blocks=num_blocks,
            kv_cache_size_tokens=geo.token_capacity(num_blocks),
            max_concurrency=round(geo.max_concurrency(num_blocks), 4),
        )
    flags = serve_args(
        tensor_parallel_size=model.tensor_parallel_size,
        pipeline_parallel_size=model.pipeline_parallel_size,
        max_model_len=geo.max_model_len,
        block_size=geo.block_size,
        kv_cache_dtype=model.kv_cache_dtype,
        dtype=args.dtype,
        max_num_batched_tokens=batched_tokens,
        max_num_seqs=max_num_seqs,
        max_concurrent_batches=args.max_concurrent_batches,
        gpu_memory_utilization=args.gpu_memory_utilization if total is not None else None,
        kv_cache_memory_bytes=memory if args.kv_cache_memory_gib is not None else None,
    )
    long = (
        args.max_model_len is not None
        and args.max_model_len
        > derived_max_model_len_and_key(text_config(config), _tokenizer_max_length(model_dir))[0]
    )
    env = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"} if allow_long and long else {}
    out["vllm_serve_args"] = flags
    out["vllm_serve_command"] = shell_line(str(model_dir or "MODEL"), flags, env)
    return out


def _render_table(p: dict[str, Any]) -> str:
    rows: list[tuple[str, str]] = [
        ("model", f"{p['architecture']} ({p['model_type'] or '?'})"),
        ("attention", f"{p['attention']}, {p['layers_per_rank']} layers per rank"),
        ("KV heads per rank x head size", f"{p['kv_heads_per_rank']} x {p['head_size']}"),
        ("sliding windows", ", ".join(map(str, p["sliding_windows"])) or "none"),
        ("recurrent-state layers", str(p["state_layers"])),
        ("attention chunks", ", ".join(map(str, p["attention_chunks"])) or "none"),
        ("KV cache groups", str(p["kv_cache_groups"])),
        (
            "dtype (model / KV cache)",
            f"{p['model_dtype']} / {p['kv_cache_dtype']} ({p['kv_element_bytes']} B per element)",
        ),
        (
            "parallelism (TP x PP)",
            f"{p['tensor_parallel_size']} x {p['pipeline_parallel_size']}",
        ),
        (
            "bytes per token (per rank)",
            f"{p['bytes_per_token']:,} ({_fmt_bytes(p['bytes_per_token'])})",
        ),
        (
            f"bytes per block ({p['block_size']} tokens)",
            f"{p['bytes_per_block']:,} ({_fmt_bytes(p['bytes_per_block'])})",
        ),
        (
            f"per sequence of {p['max_model_len']:,} tokens",
            f"{p['blocks_per_sequence']:,} blocks, {_fmt_bytes(p['bytes_per_sequence'])}",
        ),
    ]
    if "requested_bytes" in p:
        spec = GPUS[p["gpu"]] if p["gpu"] else None
        rows += [
            (
                "GPU memory (as the driver reports)",
                f"{_fmt_bytes(p['gpu_memory_bytes'])}"
                + (f" ({spec.name}: {spec.label})" if spec else " (--gpu-memory-gib)"),
            ),
            (
                f"requested (x {p['gpu_memory_utilization']})",
                _fmt_bytes(p["requested_bytes"]),
            ),
            ("weights per rank", f"{_fmt_bytes(p['weights_bytes'])} ({p['weights_source']})"),
            (
                "activation peak + other per rank",
                f"{_fmt_bytes(p['activation_bytes'])} + {_fmt_bytes(p['other_bytes'])}"
                f" ({p['overhead_source']})",
            ),
        ]
    if "num_blocks" in p:
        rows += [
            ("KV cache memory (per rank)", _fmt_bytes(p["kv_cache_memory_bytes"])),
            ("KV blocks", f"{p['num_blocks']:,}"),
            ("token capacity", f"{p['kv_cache_size_tokens']:,}"),
            (f"max concurrency at {p['max_model_len']:,} tokens", f"{p['max_concurrency']:.2f}x"),
        ]
    width = max(len(k) for k, _ in rows)
    table = "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
    return f"{table}\n\nassumes: {p['vllm_serve_command']}"


def _plan_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="KV bytes per token, per block, per sequence, and the concurrency ceiling",
        description=(
            "Size a model's KV cache as vLLM does, before deploying it: on a named GPU (--gpu) "
            "with the weights read from the model directory, refusing what vLLM refuses, and "
            "printing the vllm serve flags the figures assume."
        ),
    )
    p.add_argument("--model-config", required=True, metavar="PATH", help="model dir or config.json")
    p.add_argument(
        "--kv-cache-dtype", default="auto", help="auto (model dtype), fp8, fp8_e4m3, ..."
    )
    p.add_argument("--dtype", default="auto", help="model dtype override (auto: from the config)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="N",
        help="default: the model's (max_position_embeddings with RoPE scaling, as vLLM derives)",
    )
    p.add_argument(
        "--block-size", type=int, default=16, metavar="N", help="tokens per block (GPU: 16)"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        metavar="N",
        help="sizes the sliding-window block cap and the activation peak (default: vLLM's for "
        "the GPU; 8192 without one)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        metavar="N",
        help="sizes the sampler's share of the activation peak (default: vLLM's for the GPU)",
    )
    p.add_argument(
        "--max-concurrent-batches",
        type=int,
        default=DEFAULT_MAX_CONCURRENT_BATCHES,
        metavar="N",
        help="2 with async scheduling (vLLM's default), else 1",
    )
    memory = p.add_mutually_exclusive_group()
    memory.add_argument(
        "--gpu",
        type=_gpu_arg,
        default=None,
        metavar="NAME",
        help=f"the GPU by name: {', '.join(sorted(GPUS))} (memory as the driver reports it)",
    )
    memory.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        metavar="G",
        help="the GPU's total memory per rank, as nvidia-smi reports it, instead of --gpu",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.92, metavar="U")
    p.add_argument(
        "--weights-gib",
        type=float,
        default=None,
        metavar="W",
        help="weights per rank (default: the model directory's safetensors, else estimated "
        "from config.json, divided by TP x PP)",
    )
    p.add_argument(
        "--overhead-gib",
        type=float,
        default=None,
        metavar="O",
        help="activation peak, non-torch and CUDA-graph memory per rank (default: estimated)",
    )
    p.add_argument(
        "--kv-cache-memory-gib",
        type=float,
        default=None,
        metavar="G",
        help="KV memory per rank directly (vLLM's --kv-cache-memory-bytes)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _plan_parser(sub)
    status = sub.add_parser(
        "status",
        help="a running sidecar's pool, requests, queue, settings and refusals",
        description="Print a running sidecar's state (its /state and /readyz) for a person.",
    )
    status.add_argument("url", metavar="URL", help="its metrics port, e.g. http://127.0.0.1:9091")
    status.add_argument("--timeout", type=float, default=5.0, metavar="S", help="seconds (5)")
    status.add_argument("--json", action="store_true", help="print /state as JSON")
    sub.add_parser(
        "serve",
        help="run the admission-controlling proxy (see `kv-sidecar serve --help`)",
        add_help=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        return _serve(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "plan":
            result = plan(args)
            print(json.dumps(result) if args.json else _render_table(result))
            return 0
        if args.command == "status":
            return _status(args)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 2


def _status(args: argparse.Namespace) -> int:
    from sidecar.observability.status import StatusError, base_url, fetch, render

    if not args.timeout > 0:  # NaN too
        print(
            f"{PROG} status: error: --timeout must be positive, got {args.timeout}", file=sys.stderr
        )
        return 2
    try:
        state, ready = fetch(args.url, timeout=args.timeout)
    except StatusError as exc:
        print(f"{PROG} status: error: {one_line(str(exc))}", file=sys.stderr)
        return 1
    text = render(state, ready, base_url(args.url))
    print(json.dumps(state, indent=2) if args.json else text)
    return 0


def _serve(argv: list[str]) -> int:
    from pydantic import ValidationError
    from pydantic_settings import CliApp

    from sidecar.config import Settings, cli_args, cli_source

    try:
        # exit_on_error off: argparse's refusals come back as one SettingsError line, no usage
        settings = CliApp.run(Settings, cli_args=cli_args(argv), cli_settings_source=cli_source())
    except ValidationError as exc:
        print(f"{PROG} serve: error: {_invalid(exc)}", file=sys.stderr)
        return 2
    except ValueError as exc:  # pydantic-settings' own refusals: SettingsError, a bad flag
        message = str(exc).removeprefix("error parsing CLI: ")
        print(f"{PROG} serve: error: {one_line(message)}", file=sys.stderr)
        return 2
    from sidecar.app import run

    try:
        return run(settings)
    except ConfigError as exc:  # a --model-config that cannot be read, an exporter not installed
        print(f"{PROG} serve: error: {one_line(str(exc))}", file=sys.stderr)
        return 2


def _invalid(exc: ValidationError) -> str:
    """A settings validation error as one line: each bad field by its flag and env var.

    A union (``--workers``: a number or ``auto``) gives one error per alternative, said together.
    """
    from sidecar.config import Settings, names_of

    said: dict[str, list[str]] = {}
    got: dict[str, Any] = {}
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else ""
        message = str(error["msg"]).removeprefix("Value error, ")
        if field in said:  # another alternative of a union: "... or 'auto'"
            message = message.removeprefix("Input should be ")
        said.setdefault(field, []).append(message)
        got.setdefault(field, error.get("input"))
    parts = []
    for field, messages in said.items():
        text = ", or ".join(messages)
        info = Settings.model_fields.get(field)
        if info is None or "SecretStr" not in str(info.annotation):  # a secret is never echoed
            text += f", got {got[field]!r}"
        if field:
            flag, env = names_of(field)
            text = f"{flag} ({env}): {text}"
        parts.append(text)
    return one_line("; ".join(parts), 1000)
