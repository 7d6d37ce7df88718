"""Time a model's forward steps on a real GPU: the measurements the cost model is checked against.

    python3 -m harness.gpu_probe --model-config harness/models/llama-3.1-8b-instruct.json \\
        [--tp 8] --out probe.json

Needs PyTorch and a CUDA GPU, nothing else (no vLLM: the GPU build does not fit the machines
this project is lent; ``harness.sim_calibrate`` compares against a real vLLM where one runs).
It builds one tensor-parallel rank of a dense Llama-style model from its ``config.json``
(bf16 weights drawn at random, one tensor per weight as a checkpoint has them, the heads, the
MLP width and the vocabulary split ``--tp`` ways; tensor parallel's all-reduces are not run) and
times the passes vLLM's engine makes:

- ``decode``: ``batch`` sequences with ``context`` tokens of KV each advance one token: the
  linear layers over ``batch`` tokens, FlashAttention-style attention of each sequence's query
  against its own KV (its query heads folded onto their KV head, so the kernel reads each KV
  head once, as vLLM's grouped-query kernels do), logits for the batch, argmax. Captured in a
  CUDA graph and replayed, as vLLM runs decode.
- ``prefill``: ``sequences`` prompts of ``tokens`` each, computed in one step (causal
  attention over the new tokens), logits for each prompt's last token; eager (vLLM's piecewise
  graphs leave attention eager, and a step of thousands of tokens hides its launches).
- ``chunk``: one chunked-prefill step of ``tokens`` new tokens after ``context`` tokens already
  in KV (attention over the context without a mask plus causal attention over the new tokens,
  the FLOPs of the exact computation; the two parts' softmax merge is left out).
- ``mixed``: a decode batch and one prefill chunk in the same step (chunked prefill): the linear
  layers once over all tokens, the two attentions one after the other.

Each case reports the median over ``--repeats`` timings, each the mean of ``--iters``
back-to-back runs timed with CUDA events, after a warm-up. It also measures the GPU itself: a
device-to-device copy's bandwidth (bytes read plus written) and a large bf16 matrix product's
rate, so that the cost model's efficiencies can be read against what this GPU gives.

The output is JSON (written after every case, so a run cut short keeps what it measured);
``python -m harness.sim_calibrate --probe FILE --gpu NAME`` prints it against the simulation's
``step_cost`` for the same batches.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

DTYPE = torch.bfloat16


class Shard:
    """One tensor-parallel rank of a dense Llama-style decoder, random bf16 weights."""

    def __init__(self, cfg: dict[str, Any], tp: int, max_kv_tokens: int, device: str) -> None:
        self.hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        self.head_dim = int(cfg.get("head_dim") or self.hidden // heads)
        self.heads = heads // tp
        self.kv_heads = max(1, kv_heads // tp)  # vLLM replicates KV heads past tp = kv_heads
        self.inter = int(cfg["intermediate_size"]) // tp
        self.vocab = math.ceil(int(cfg["vocab_size"]) / tp)
        self.layers = int(cfg["num_hidden_layers"])
        self.eps = float(cfg.get("rms_norm_eps", 1e-5))
        self.device = device
        h, d = self.hidden, self.head_dim

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=device, dtype=DTYPE) * 0.02

        self.embed = w(self.vocab, h)
        self.lm_head = w(h, self.vocab)
        self.final_norm = torch.ones(h, device=device, dtype=DTYPE)
        qkv = (self.heads + 2 * self.kv_heads) * d
        self.blocks = [
            {
                "n1": torch.ones(h, device=device, dtype=DTYPE),
                "qkv": w(h, qkv),
                "o": w(self.heads * d, h),
                "n2": torch.ones(h, device=device, dtype=DTYPE),
                "gate_up": w(h, 2 * self.inter),
                "down": w(self.inter, h),
            }
            for _ in range(self.layers)
        ]
        # one K and one V buffer per layer, viewed as [batch, kv_heads, context, head_dim]
        per = max_kv_tokens * self.kv_heads * d
        self.k = [torch.zeros(per, device=device, dtype=DTYPE) for _ in range(self.layers)]
        self.v = [torch.zeros(per, device=device, dtype=DTYPE) for _ in range(self.layers)]

    def weight_bytes(self) -> int:
        per_layer = sum(t.numel() for t in self.blocks[0].values()) * 2
        return per_layer * self.layers + (self.embed.numel() + self.lm_head.numel()) * 2

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.hidden,), weight, self.eps)

    def _kv(self, layer: int, batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = batch * self.kv_heads * context * self.head_dim
        shape = (batch, self.kv_heads, context, self.head_dim)
        return self.k[layer][:n].view(shape), self.v[layer][:n].view(shape)

    def _mlp(self, x: torch.Tensor, b: dict[str, torch.Tensor]) -> torch.Tensor:
        g, u = (self._norm(x, b["n2"]) @ b["gate_up"]).chunk(2, dim=-1)
        return x + (F.silu(g) * u) @ b["down"]

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.head_dim
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        return q, k, v

    def _decode_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, context: int
    ) -> torch.Tensor:
        batch = q.shape[0]
        kc, vc = self._kv(layer, batch, context)
        d, g = self.head_dim, self.heads // self.kv_heads
        kc[:, :, context - 1, :] = k.view(batch, self.kv_heads, d)
        vc[:, :, context - 1, :] = v.view(batch, self.kv_heads, d)
        # a KV head's g query heads as g queries of that head: one read of its KV
        out = F.scaled_dot_product_attention(q.view(batch, self.kv_heads, g, d), kc, vc)
        return out.reshape(batch, self.heads * d)

    def _prefill_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sequences: int, context: int
    ) -> torch.Tensor:
        d = self.head_dim
        tokens = q.shape[0] // sequences
        q4 = q.view(sequences, tokens, self.heads, d).transpose(1, 2)
        k4 = k.view(sequences, tokens, self.kv_heads, d).transpose(1, 2)
        v4 = v.view(sequences, tokens, self.kv_heads, d).transpose(1, 2)
        g = self.heads // self.kv_heads
        # KV heads repeated to the query heads (a copy far cheaper than the attention) so that
        # the fused causal kernel runs whatever grouped-query support this PyTorch has
        k4, v4 = k4.repeat_interleave(g, dim=1), v4.repeat_interleave(g, dim=1)
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)
        if context:
            kc, vc = self._kv(0, sequences, context)
            kc, vc = kc.repeat_interleave(g, dim=1), vc.repeat_interleave(g, dim=1)
            out = out + F.scaled_dot_product_attention(q4, kc, vc)
        return out.transpose(1, 2).reshape(sequences * tokens, self.heads * d)

    def step(
        self,
        ids: torch.Tensor,
        *,
        decode: tuple[int, int] = (0, 0),
        prefill: tuple[int, int, int] = (0, 0, 0),
    ) -> torch.Tensor:
        """One engine step: ``decode=(batch, context)`` sequences advancing one token, then
        ``prefill=(sequences, tokens, context)`` prompt tokens (their ids after the decodes')."""
        nd, ctx = decode
        ps, pt, pctx = prefill
        x = self.embed[ids]
        for i, b in enumerate(self.blocks):
            q, k, v = self._split(self._norm(x, b["n1"]) @ b["qkv"])
            parts = []
            if nd:
                parts.append(self._decode_attention(q[:nd], k[:nd], v[:nd], i, ctx))
            if ps:
                parts.append(self._prefill_attention(q[nd:], k[nd:], v[nd:], ps, pctx))
            attn = parts[0] if len(parts) == 1 else torch.cat(parts)
            x = self._mlp(x + attn @ b["o"], b)
        if ps:  # eager: a host-side index is fine (a captured decode step takes none)
            x = x[[*range(nd), *(nd + (s + 1) * pt - 1 for s in range(ps))]]
        logits = self._norm(x, self.final_norm) @ self.lm_head
        return logits.argmax(dim=-1)

    def decode_layer(
        self,
        x: torch.Tensor,
        b: dict[str, torch.Tensor],
        kc: torch.Tensor,
        vc: torch.Tensor,
        context: int,
    ) -> torch.Tensor:
        """One layer of a decode step on its KV views ``kc``, ``vc`` (the unit
        ``torch.compile`` fuses: norms, residual adds, the activation, the KV write)."""
        batch, d = x.shape[0], self.head_dim
        q, k, v = self._split(self._norm(x, b["n1"]) @ b["qkv"])
        kc[:, :, context - 1, :] = k.view(batch, self.kv_heads, d)
        vc[:, :, context - 1, :] = v.view(batch, self.kv_heads, d)
        g = self.heads // self.kv_heads
        out = F.scaled_dot_product_attention(q.view(batch, self.kv_heads, g, d), kc, vc)
        return self._mlp(x + out.reshape(batch, self.heads * d) @ b["o"], b)

    def decode_step(self, ids: torch.Tensor, context: int, layer: Any) -> torch.Tensor:
        """A decode step through ``layer`` (:meth:`decode_layer`, or it compiled)."""
        batch = ids.shape[0]
        x = self.embed[ids]
        for i, b in enumerate(self.blocks):
            kc, vc = self._kv(i, batch, context)
            x = layer(x, b, kc, vc, context)
        return (self._norm(x, self.final_norm) @ self.lm_head).argmax(dim=-1)


def _time(fn: Any, iters: int, repeats: int, cuda: bool) -> list[float]:
    for _ in range(2):
        fn()
    out = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append((time.perf_counter() - t0) / iters)
    return out


def _graphed(fn: Any) -> Any:
    """``fn`` captured in a CUDA graph (static inputs), returned as its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def gpu_rates(device: str, cuda: bool) -> dict[str, float]:
    """This GPU's copy bandwidth (bytes read + written per second) and bf16 GEMM rate."""
    n = (1 << 30) if cuda else (1 << 22)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = _time(lambda: dst.copy_(src), 10, 3, cuda)
    m = 8192 if cuda else 256
    a = torch.randn(m, m, device=device, dtype=DTYPE)
    b = torch.randn(m, m, device=device, dtype=DTYPE)
    mm = _time(lambda: a @ b, 10, 3, cuda)
    return {
        "copy_bytes_per_second": 2 * n / statistics.median(copy),
        "bf16_gemm_flops_per_second": 2 * m**3 / statistics.median(mm),
    }


def default_cases(small: bool) -> list[dict[str, int | str]]:
    if small:  # a CPU smoke run of the code paths
        return [
            {"kind": "decode", "batch": 2, "context": 16},
            {"kind": "decode", "batch": 4, "context": 32, "graphs": 0},
            {"kind": "prefill", "sequences": 1, "tokens": 32},
            {"kind": "chunk", "tokens": 16, "context": 32},
            {"kind": "mixed", "batch": 2, "context": 16, "tokens": 16},
        ]
    cases: list[dict[str, int | str]] = []
    for context in (512, 2048, 8192):
        for batch in (1, 8, 32, 64, 128, 256, 512):
            if batch * context <= 1 << 19:
                cases.append({"kind": "decode", "batch": batch, "context": context})
    cases += [
        {"kind": "decode", "batch": 1, "context": 2048, "graphs": 0},
        {"kind": "decode", "batch": 64, "context": 2048, "graphs": 0},
        {"kind": "prefill", "sequences": 1, "tokens": 128},
        {"kind": "prefill", "sequences": 1, "tokens": 512},
        {"kind": "prefill", "sequences": 1, "tokens": 2048},
        {"kind": "prefill", "sequences": 4, "tokens": 2048},
        {"kind": "prefill", "sequences": 1, "tokens": 8192},
        {"kind": "chunk", "tokens": 8192, "context": 8192},
        {"kind": "chunk", "tokens": 8192, "context": 24576},
        {"kind": "mixed", "batch": 64, "context": 2048, "tokens": 512},
        {"kind": "mixed", "batch": 128, "context": 2048, "tokens": 2048},
        {"kind": "mixed", "batch": 256, "context": 1024, "tokens": 4096},
    ]
    return cases


def run_case(shard: Shard, case: dict[str, Any], iters: int, repeats: int, cuda: bool) -> float:
    kind = case["kind"]
    dev = shard.device
    if kind == "decode":
        batch, context = int(case["batch"]), int(case["context"])
        ids = torch.randint(0, shard.vocab, (batch,), device=dev)
        fn = lambda: shard.step(ids, decode=(batch, context))  # noqa: E731
        if case.get("compiled"):
            layer = torch.compile(shard.decode_layer, dynamic=False)
            fn = lambda: shard.decode_step(ids, context, layer)  # noqa: E731
        if cuda and case.get("graphs", 1):
            fn = _graphed(fn)
        times = _time(fn, iters, repeats, cuda)
    else:
        batch = int(case.get("batch", 0)) if kind == "mixed" else 0
        dctx = int(case.get("context", 0)) if kind == "mixed" else 0
        seqs = int(case.get("sequences", 1))
        tokens = int(case["tokens"])
        pctx = int(case.get("context", 0)) if kind == "chunk" else 0
        ids = torch.randint(0, shard.vocab, (batch + seqs * tokens,), device=dev)
        fn = lambda: shard.step(  # noqa: E731
            ids, decode=(batch, dctx), prefill=(seqs, tokens, pctx)
        )
        times = _time(fn, max(1, iters // 4), repeats, cuda)
    case["samples_s"] = times
    case["seconds"] = statistics.median(times)
    return case["seconds"]


#: substrings of a CUDA kernel's name, lowercased, by the class of work it does
KERNEL_CLASSES = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "sm90", "cublas", "splitk")),
)


def kernel_class(name: str) -> str:
    """``attention``, ``gemm`` or ``other`` (norms, activations, copies, the KV write).

    >>> kernel_class("nvjet_sm90_tst_128x64_64x8_2x4_h_bz_splitK_NNT")
    'gemm'
    >>> kernel_class("void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128>")
    'attention'
    >>> kernel_class("void at::native::vectorized_layer_norm_kernel<c10::BFloat16, float, true>")
    'other'
    """
    low = name.lower()
    for label, keys in KERNEL_CLASSES:
        if any(k in low for k in keys):
            return label
    return "other"


def profile_case(shard: Shard, case: dict[str, Any], steps: int = 5) -> dict[str, Any]:
    """Where one eager decode step's GPU time goes, by kernel class (PyTorch's profiler; eager,
    so that each kernel is seen: the kernels' own times, not the launch gaps between them)."""
    from torch.profiler import ProfilerActivity, profile

    batch, context = int(case["batch"]), int(case["context"])
    ids = torch.randint(0, shard.vocab, (batch,), device=shard.device)
    for _ in range(2):
        shard.step(ids, decode=(batch, context))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            shard.step(ids, decode=(batch, context))
        torch.cuda.synchronize()
    classes: dict[str, dict[str, float]] = {}
    kernels = []
    for e in prof.key_averages():
        total = float(getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0))
        if total <= 0 or e.count == 0:
            continue
        label = kernel_class(e.key)
        acc = classes.setdefault(label, {"us_per_step": 0.0, "kernels_per_step": 0.0})
        acc["us_per_step"] += total / steps
        acc["kernels_per_step"] += e.count / steps
        kernels.append({"name": e.key[:120], "class": label, "us_per_step": total / steps})
    kernels.sort(key=lambda k: -k["us_per_step"])
    return {
        "kind": "profile",
        "batch": batch,
        "context": context,
        "classes": classes,
        "top": kernels[:12],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m harness.gpu_probe", description=__doc__)
    p.add_argument("--model-config", required=True, help="a Hugging Face config.json")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (one rank is timed)")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--small", action="store_true", help="tiny cases (a CPU smoke run)")
    p.add_argument(
        "--compiled",
        default="",
        help="BATCHxCONTEXT,...: instead of the default cases, each decode step timed as it is "
        "and with its layer through torch.compile (fused as vLLM compiles its model)",
    )
    p.add_argument(
        "--profile",
        default="",
        help="BATCHxCONTEXT,...: instead of timing, where eager decode steps' GPU time goes",
    )
    args = p.parse_args(argv)
    cfg = json.loads(Path(args.model_config).read_text())
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if not cuda and not args.small:
        print("gpu_probe: no CUDA GPU (use --small for a CPU smoke run)", file=sys.stderr)
        return 2
    profiles = [tuple(map(int, c.split("x"))) for c in args.profile.split(",") if c]
    if profiles and not cuda:
        print("gpu_probe: --profile needs a CUDA GPU", file=sys.stderr)
        return 2
    compiled = [tuple(map(int, c.split("x"))) for c in args.compiled.split(",") if c]
    cases: list[dict[str, Any]] = (
        [{"kind": "decode", "batch": b, "context": c} for b, c in profiles]
        if profiles
        else [
            {"kind": "decode", "batch": b, "context": c, **({"compiled": 1} if comp else {})}
            for b, c in compiled
            for comp in (False, True)
        ]
        if compiled
        else list(default_cases(args.small))
    )
    max_kv = max(
        int(c.get("batch", 0)) * int(c.get("context", 0))
        + int(c.get("sequences", 1)) * int(c.get("context", 0) if c["kind"] == "chunk" else 0)
        for c in cases
    )
    torch.manual_seed(0)
    out: dict[str, Any] = {
        "model_config": Path(args.model_config).name,
        "tp": args.tp,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "iters": args.iters,
        "repeats": args.repeats,
    }
    if not profiles:
        out.update(gpu_rates(device, cuda))
    shard = Shard(cfg, args.tp, max_kv, device)
    out["weight_bytes_per_rank"] = shard.weight_bytes()
    out["cases"] = []
    path = Path(args.out)
    for case in cases:
        started = time.monotonic()
        try:
            with torch.inference_mode():
                if profiles:
                    case.update(profile_case(shard, case))
                else:
                    run_case(shard, case, args.iters, args.repeats, cuda)
        except Exception as exc:  # a case that fails is recorded, the others still run
            case["error"] = f"{type(exc).__name__}: {exc}"[:300]
        out["cases"].append(case)
        path.write_text(json.dumps(out, indent=1))
        print(
            f"{json.dumps({k: v for k, v in case.items() if k != 'samples_s'})}"
            f" ({time.monotonic() - started:.1f} s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
