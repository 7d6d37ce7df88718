"""The ``kv-sidecar`` command: ``serve`` (the proxy) and ``plan`` (the offline capacity calculator).

Errors end with one line on stderr (``kv-sidecar: error: ...``) and a non-zero exit, never a
traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sidecar import __version__
from sidecar.errors import ConfigError, one_line
from sidecar.kv.geometry import (
    DEFAULT_MAX_CONCURRENT_BATCHES,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    GIB,
    KVGeometry,
    ModelKV,
    kv_cache_memory_bytes,
    load_config,
)

if TYPE_CHECKING:
    from pydantic import ValidationError

PROG = "kv-sidecar"


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """Compute the capacity figures for one model config (what ``kv-sidecar plan`` prints)."""
    config = load_config(args.model_config)
    model = ModelKV.from_config(
        config,
        kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        dtype=args.dtype,
    )
    geo = KVGeometry.build(
        model,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_concurrent_batches=args.max_concurrent_batches,
    )
    out: dict[str, Any] = {
        "architecture": model.architecture,
        "model_type": model.model_type,
        "attention": model.attention,
        "layers_per_rank": model.num_layers,
        "kv_heads_per_rank": model.kv_heads_per_rank,
        "head_size": model.head_size,
        "sliding_windows": list(model.sliding_windows),
        "kv_cache_groups": len(geo.groups),
        "model_dtype": model.model_dtype,
        "kv_cache_dtype": model.kv_cache_dtype,
        "kv_element_bytes": model.dtype_bytes,
        "tensor_parallel_size": model.tensor_parallel_size,
        "pipeline_parallel_size": model.pipeline_parallel_size,
        "block_size": geo.block_size,
        "max_model_len": geo.max_model_len,
        "bytes_per_token": geo.bytes_per_token,
        "bytes_per_block": geo.bytes_per_block,
        "blocks_per_sequence": geo.blocks_per_sequence,
        "bytes_per_sequence": geo.bytes_per_sequence,
    }
    memory: int | None = None
    if args.kv_cache_memory_gib is not None:
        if args.kv_cache_memory_gib <= 0:
            raise ConfigError(
                f"--kv-cache-memory-gib must be positive, got {args.kv_cache_memory_gib}"
            )
        memory = int(args.kv_cache_memory_gib * GIB)
    elif args.gpu_memory_gib is not None:
        memory = kv_cache_memory_bytes(
            args.gpu_memory_gib, args.gpu_memory_utilization, args.weights_gib
        )
    elif args.weights_gib:
        raise ConfigError("--weights-gib needs --gpu-memory-gib")
    if memory is not None:
        num_blocks = geo.num_blocks(memory)
        out.update(
            kv_cache_memory_bytes=memory,
            num_blocks=num_blocks,
            kv_cache_size_tokens=geo.token_capacity(num_blocks),
            max_concurrency=round(geo.max_concurrency(num_blocks), 4),
        )
    return out


def _render_table(p: dict[str, Any]) -> str:
    rows: list[tuple[str, str]] = [
        ("model", f"{p['architecture']} ({p['model_type'] or '?'})"),
        ("attention", f"{p['attention']}, {p['layers_per_rank']} layers per rank"),
        ("KV heads per rank x head size", f"{p['kv_heads_per_rank']} x {p['head_size']}"),
        ("sliding windows", ", ".join(map(str, p["sliding_windows"])) or "none"),
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
    if "num_blocks" in p:
        rows += [
            ("KV cache memory (per rank)", _fmt_bytes(p["kv_cache_memory_bytes"])),
            ("KV blocks", f"{p['num_blocks']:,}"),
            ("token capacity", f"{p['kv_cache_size_tokens']:,}"),
            (f"max concurrency at {p['max_model_len']:,} tokens", f"{p['max_concurrency']:.2f}x"),
        ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _plan_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="KV bytes per token, per block, per sequence, and the concurrency ceiling",
        description="Size a model's KV cache exactly as vLLM does, before deploying it.",
    )
    p.add_argument("--model-config", required=True, metavar="PATH", help="model dir or config.json")
    p.add_argument(
        "--kv-cache-dtype", default="auto", help="auto (model dtype), fp8, fp8_e4m3, ..."
    )
    p.add_argument("--dtype", default="auto", help="model dtype override (auto: from the config)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N")
    p.add_argument(
        "--block-size", type=int, default=16, metavar="N", help="tokens per block (GPU: 16)"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        metavar="N",
        help="sizes the sliding-window block cap",
    )
    p.add_argument(
        "--max-concurrent-batches",
        type=int,
        default=DEFAULT_MAX_CONCURRENT_BATCHES,
        metavar="N",
        help="2 with async scheduling (vLLM's default), else 1",
    )
    p.add_argument("--gpu-memory-gib", type=float, default=None, metavar="G")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.92, metavar="U")
    p.add_argument(
        "--weights-gib",
        type=float,
        default=0.0,
        metavar="W",
        help="weights and other non-KV memory per rank",
    )
    p.add_argument(
        "--kv-cache-memory-gib",
        type=float,
        default=None,
        metavar="G",
        help="KV memory per rank directly (like VLLM_CPU_KVCACHE_SPACE)",
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
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 2


def _serve(argv: list[str]) -> int:
    from pydantic import ValidationError
    from pydantic_settings import CliApp

    from sidecar.config import Settings, cli_args

    try:
        # exit_on_error off: argparse's refusals come back as one SettingsError line, no usage
        settings = CliApp.run(Settings, cli_args=cli_args(argv), cli_exit_on_error=False)
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
