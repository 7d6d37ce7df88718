"""`make demo`: the same burst straight to vLLM and through the sidecar, side by side.

Starts the real vLLM (CPU build, generated model, 64 KV blocks of 128 tokens), starts
`kv-sidecar serve` in front of it, sends 20 concurrent requests of 271 prompt tokens and 700
max_tokens (ignore_eos) both ways, prints what happened, and leaves both running until Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time

import httpx

from harness.vllm_cpu import VllmServer, ensure_model
from harness.workload import (
    SidecarProcess,
    burst,
    make_prompts,
    metric_value,
    summarize,
    vllm_preemptions,
)

BURST, PROMPT, MAX_TOKENS, BLOCKS = 20, 271, 700, 64


def say(msg: str) -> None:
    print(msg, flush=True)


class Progress:
    """A one-line live view of vLLM's KV usage and the sidecar's ledger while a burst runs."""

    def __init__(self, vllm_url: str, sidecar: SidecarProcess | None) -> None:
        self.vllm_url, self.sidecar = vllm_url, sidecar
        self._stop = threading.Event()
        self.kv_samples: list[tuple[float, float]] = []  # (predicted, actual) blocks
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.wait(0.5):
            with contextlib.suppress(httpx.HTTPError):
                text = httpx.get(self.vllm_url + "/metrics", timeout=2).text
                usage = metric_value(text, "vllm:kv_cache_usage_perc") or 0.0
                running = metric_value(text, "vllm:num_requests_running") or 0
                waiting = metric_value(text, "vllm:num_requests_waiting") or 0
                pre = metric_value(text, "vllm:num_preemptions_total") or 0
                line = (
                    f"  {time.monotonic() - t0:5.1f}s  vLLM KV {usage:6.1%}  running "
                    f"{running:3.0f}  waiting {waiting:3.0f}  preemptions {pre:4.0f}"
                )
                if self.sidecar is not None:
                    st = self.sidecar.state()
                    line += (
                        f"  | sidecar in flight {st['in_flight']:3d} queued "
                        f"{st['queue_depth']:3d} predicted {st['predicted_blocks']:3d} "
                        f"blocks"
                    )
                    if st["predicted_at_snapshot_blocks"] is not None and st["actual_blocks"]:
                        self.kv_samples.append(
                            (st["predicted_at_snapshot_blocks"], st["actual_blocks"])
                        )
                sys.stdout.write("\r" + line)
                sys.stdout.flush()

    def __enter__(self) -> Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        sys.stdout.write("\n")


def run_burst(
    label: str, url: str, vllm_url: str, prompts: list[str], sidecar: SidecarProcess | None
) -> dict[str, float]:
    say(f"\n== {label}: {BURST} requests x ({PROMPT} prompt + {MAX_TOKENS} max_tokens) ==")
    before = vllm_preemptions(vllm_url)
    t0 = time.monotonic()
    with Progress(vllm_url, sidecar) as progress:
        results = asyncio.run(burst(url, prompts, max_tokens=MAX_TOKENS))
    figures = summarize(results, time.monotonic() - t0)
    figures["preemptions"] = vllm_preemptions(vllm_url) - before
    figures["wall_s"] = time.monotonic() - t0
    if progress.kv_samples:
        errors = [p - a for p, a in progress.kv_samples]
        figures["kv_error_mean_blocks"] = sum(errors) / len(errors)
        figures["kv_error_max_blocks"] = max(errors, key=abs)
    if sidecar is not None:
        m = sidecar.metrics()
        figures["queued"] = (
            metric_value(m, "kv_sidecar_requests_total", decision="admit", reason="queued") or 0
        )
    return figures


def main() -> int:
    say("Setting up: vLLM CPU build, the generated model (first run: a few minutes)...")
    model_dir = ensure_model()
    vllm = VllmServer(num_gpu_blocks=BLOCKS)
    vllm.start()
    sidecar = SidecarProcess(vllm.url, "--policy", "queue", "--max-queue-wait", "600")
    try:
        sidecar.start()
        say(f"vLLM    {vllm.url}  ({BLOCKS} KV blocks of 128 tokens, max_model_len 1024)")
        say(f"sidecar {sidecar.url}  (metrics {sidecar.metrics_url}/metrics)")
        prompts = make_prompts(model_dir, BURST, PROMPT, seed=1)
        direct = run_burst("straight to vLLM", vllm.url, vllm.url, prompts, None)
        through = run_burst(
            "through the sidecar (--policy queue)", sidecar.url, vllm.url, prompts, sidecar
        )
        rows = [
            ("preemptions", "preemptions", "{:.0f}"),
            ("completed", "completed", "{:.0f}"),
            ("refused (429)", "refused", "{:.0f}"),
            ("queued by the sidecar", "queued", "{:.0f}"),
            ("goodput (tokens/s)", "goodput_tokens_per_s", "{:.0f}"),
            ("p50 latency (s)", "p50_latency_s", "{:.2f}"),
            ("p99 latency (s)", "p99_latency_s", "{:.2f}"),
            ("p50 TTFT (s)", "p50_ttft_s", "{:.2f}"),
            ("p99 TTFT (s)", "p99_ttft_s", "{:.2f}"),
            ("predicted - actual KV, mean (blocks)", "kv_error_mean_blocks", "{:+.2f}"),
            ("predicted - actual KV, max (blocks)", "kv_error_max_blocks", "{:+.0f}"),
        ]
        say(f"\n{'':38}{'direct':>12}{'sidecar':>12}")
        for label, key, fmt in rows:
            cells = [fmt.format(d[key]) if key in d else "-" for d in (direct, through)]
            say(f"{label:38}{cells[0]:>12}{cells[1]:>12}")
        say(
            f"\nBoth are still running: vLLM {vllm.url}, sidecar {sidecar.url} "
            f"(metrics {sidecar.metrics_url}/metrics). Ctrl-C to stop."
        )
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(1)
    finally:
        sidecar.stop()
        vllm.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
