"""A vLLM executor that runs no model: vLLM's own server, scheduler and KV-cache manager on a
simulated GPU clock.

vLLM resolves ``--distributed-executor-backend harness.sim_executor.SimExecutor`` by its
qualified name (``Executor.get_class``) inside the engine-core process. Everything above the
executor stays vLLM's own and runs unchanged: the OpenAI server, the engine core, the scheduler
with chunked prefill and preemption, the KV-cache manager with prefix caching, the metrics.
What this class replaces is the worker: it

- reports the KV-cache spec a real model runner would (layers, KV heads per rank, head size,
  dtype, from vLLM's own ``ModelConfig`` helpers) at the GPU's block size (16 unless
  ``--block-size`` says otherwise; ``harness.sim_vllm`` passes it because vLLM's CPU platform
  would pick 128), and the KV memory a GPU worker would find on the named GPU
  (``harness.sim_cost.memory_budget``); vLLM itself then makes the blocks (honouring
  ``--num-gpu-blocks-override`` and ``--kv-cache-memory-bytes``);
- answers each ``execute_model`` with one token per scheduled request whose prefill is done
  (none for a partial prefill chunk), after sleeping the step's time from the roofline cost
  model (``harness.sim_cost.step_cost``) in real time;
- ends a request where the workload says: a request whose sampling ``extra_args`` carry
  ``sim_output_tokens: L`` (``"vllm_xargs": {"sim_output_tokens": L}`` in the OpenAI request;
  the sidecar never reads it) gets the EOS token as its L-th token, unless ``ignore_eos`` is set
  or ``min_tokens`` forbids it; otherwise it runs to ``max_tokens`` (vLLM stops it there).

Settings come from the environment (``harness.sim_vllm`` sets them; the engine core inherits
them):

    KV_SIDECAR_SIM_GPU       GPU name (harness.gpus), default h100-80gb
    KV_SIDECAR_SIM_STEP      "roofline" (default): each step sleeps the cost model's time;
                             "manual": each step waits for a grant on the control channel and
                             then returns at once; a number: every step takes that many seconds
    KV_SIDECAR_SIM_CONTROL   host:port for the control channel (any mode; required by manual);
                             data-parallel engine i listens on port + i
    KV_SIDECAR_SIM_TOKEN_ID  the token id emitted for every generated token but EOS
    KV_SIDECAR_SIM_TIME_SCALE
                             wall seconds per simulated second, default 1: every step sleeps
                             this many times its cost (roofline or fixed), so that the host's
                             CPU has that much more time per step; simulated_seconds stay in
                             GPU seconds (harness.sim_cost.StepClock)
    KV_SIDECAR_SIM_TRACE     a file to append one JSON line per step to (unset: none):
                             {"start": wall clock (time.time()) when the step began,
                             "simulated": simulated seconds before it, "seconds": its
                             simulated length, "new": [[request id, prompt tokens], ...] for
                             the requests it schedules for the first time, "work": [[request
                             id, tokens computed, context before them], ...]}; for finding
                             where a request's time went, in a benchmark's side run

The control channel is plain HTTP with JSON answers:

    GET  /state              {"steps", "granted", "waiting", "mode", "gpu", "simulated_seconds",
                              "time_scale", "cpu_lag_seconds", "cpu_lag_simulated_seconds",
                              "last_step": {...}}  (waiting: a batch is scheduled and blocked;
                              cpu_lag_seconds: see SimEngine)
    POST /step {"n": N, "timeout": S}
                             grant N steps; answers once they have run (or at the timeout) with
                             the state and "done": true/false (manual mode only: 409 otherwise)
    POST /mode {"mode": M, "time_scale": X}
                             switch the step mode at run time (roofline, manual or seconds;
                             leaving manual releases a step waiting for its grant) and/or the
                             time scale (either key may be left out, not both)
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
from vllm.logger import init_logger
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, LogprobsLists, ModelRunnerOutput

from harness import sim_cost
from harness.gpus import GpuSpec, gpu

# under "vllm." so that vLLM's logging config (level, format) applies to these lines
logger = init_logger(f"vllm.{__name__}")

ENV_GPU = "KV_SIDECAR_SIM_GPU"
ENV_STEP = "KV_SIDECAR_SIM_STEP"
ENV_CONTROL = "KV_SIDECAR_SIM_CONTROL"
ENV_TOKEN = "KV_SIDECAR_SIM_TOKEN_ID"
ENV_TIME_SCALE = sim_cost.ENV_TIME_SCALE
ENV_TRACE = "KV_SIDECAR_SIM_TRACE"
#: The key in a request's sampling ``extra_args`` (OpenAI ``vllm_xargs``) giving its length.
OUTPUT_TOKENS_KEY = "sim_output_tokens"
DEFAULT_TOKEN_ID = 100
#: vLLM's block size on CUDA GPUs when none is given.
GPU_DEFAULT_BLOCK_SIZE = 16
#: Log-probs asked for are answered with the sampled token at 0 and the rest at this value
#: (finite: OpenAI's JSON has no -inf), at most this many alternatives.
FILLER_LOGPROB = -100.0
MAX_LOGPROBS = 20


def _length(value: Any, req_id: str) -> int | None:
    """A request's ``sim_output_tokens``; one that is not a number is ignored (with a warning),
    never an exception inside the engine's step, which would end the engine."""
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        logger.warning(
            "request %s: %s=%r is not a number; ignored", req_id, OUTPUT_TOKENS_KEY, value
        )
        return None


@dataclass
class _Seq:
    """What the executor remembers of one request (as a model runner keeps its input batch)."""

    prompt_tokens: int
    output_tokens: int
    computed_tokens: int
    target_tokens: int | None
    eos_token_id: int | None
    min_tokens: int
    num_logprobs: int | None = None
    max_tokens: int | None = None
    #: a preempted request's tokens to compute again: positions below this one are recompute
    recompute_until: int = 0


@dataclass
class StepRecord:
    """The last step, as the control channel reports it."""

    requests: int
    tokens: int
    sampled: int
    seconds: float
    linear_seconds: float
    attention_seconds: float


class SimEngine:
    """The simulated model runner: KV spec, memory, and one step's tokens and time."""

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.parallel_config = vllm_config.parallel_config
        self.scheduler_config = vllm_config.scheduler_config
        self.gpu: GpuSpec = gpu(os.environ.get(ENV_GPU, "h100-80gb"))
        self.tp = self.parallel_config.tensor_parallel_size
        hf = self.model_config.hf_text_config.to_dict()
        self.shape = sim_cost.ModelShape.from_config(hf)
        self.kv_dtype = kv_cache_dtype_str_to_dtype(
            self.cache_config.cache_dtype, self.model_config
        )
        self.kv_dtype_bytes = self.kv_dtype.itemsize
        self.mode = "roofline"
        self.fixed_step_seconds: float | None = None
        self._busy = False
        self.gate = sim_cost.StepGate(manual=False)
        self.set_mode(os.environ.get(ENV_STEP, "roofline"))
        self.token_id = int(os.environ.get(ENV_TOKEN, DEFAULT_TOKEN_ID))
        self.seqs: dict[str, _Seq] = {}
        self.simulated_seconds = 0.0
        self.recomputed_tokens = 0  # tokens of preempted requests computed again ...
        self.recompute_seconds = 0.0  # ... and what they added to their steps' cost model time
        self.last_step: StepRecord | None = None
        #: paces the steps; its cpu_lag_seconds are the wall seconds by which busy steps ended
        #: later than the simulated GPU (dilated by the time scale) would have finished them:
        #: the engine's own CPU work (scheduling, output processing) that the previous step
        #: could not hide. Small against time_scale x simulated_seconds means the clock is the
        #: cost model's; large means this machine's CPU is the limit.
        self.clock = sim_cost.StepClock(sim_cost.parse_time_scale(os.environ.get(ENV_TIME_SCALE)))
        trace = os.environ.get(ENV_TRACE, "")
        self._trace = open(trace, "a", encoding="utf-8") if trace else None
        self._control: ThreadingHTTPServer | None = None
        control = os.environ.get(ENV_CONTROL, "")
        if control:
            # with data parallelism each engine core has its executor: engine i listens on
            # port + i
            host, _, port = control.rpartition(":")
            rank = self.parallel_config.data_parallel_index or 0
            self._control = _serve_control(self, f"{host}:{int(port) + rank}")
        elif self.mode == "manual":
            raise ValueError(f"{ENV_STEP}=manual needs {ENV_CONTROL}=host:port")

    @property
    def cpu_lag_seconds(self) -> float:
        return self.clock.cpu_lag_seconds

    def set_time_scale(self, scale: float | str) -> None:
        self.clock.set_time_scale(scale)
        self._busy = False  # the next step's gap is not lag at the old pace

    def set_mode(self, mode: str) -> None:
        """``roofline``, ``manual`` or a fixed step time in seconds (as ``KV_SIDECAR_SIM_STEP``)."""
        mode = mode.strip() or "roofline"
        fixed: float | None = None
        if mode not in ("roofline", "manual"):
            try:
                fixed = float(mode)
            except ValueError:
                raise ValueError(
                    f"step mode must be roofline, manual or seconds, got {mode!r}"
                ) from None
            if fixed < 0:
                raise ValueError(f"a fixed step time must not be negative, got {fixed}")
            mode = "fixed"
        self.mode, self.fixed_step_seconds = mode, fixed
        self._busy = False  # the time until the next step is not lag of this engine
        self.gate.set_manual(mode == "manual")

    # --- startup: what a GPU worker reports ---

    def kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        mc, pc = self.model_config, self.parallel_config
        # vLLM's CPU platform picks 128 when no --block-size is given; a GPU's default is 16.
        # The engine core takes the block size from these specs (and tells the API server).
        block_size = self.cache_config.block_size
        if not getattr(self.cache_config, "user_specified_block_size", True):
            block_size = GPU_DEFAULT_BLOCK_SIZE
        layers = mc.get_num_layers(pc)
        head_size = mc.get_head_size()
        window = mc.get_sliding_window()
        layer_types = getattr(mc.hf_text_config, "layer_types", None)
        specs: dict[str, KVCacheSpec] = {}
        for i in range(layers):
            name = f"model.layers.{i}.self_attn.attn"
            if mc.use_mla:
                specs[name] = MLAAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=1,
                    head_size=head_size,
                    dtype=self.kv_dtype,
                    cache_dtype_str=self.cache_config.cache_dtype,
                )
                continue
            kv_heads = mc.get_num_kv_heads(pc)
            sliding = window is not None and (
                layer_types is None or layer_types[i] == "sliding_attention"
            )
            if sliding:
                assert window is not None
                specs[name] = SlidingWindowSpec(
                    block_size=block_size,
                    num_kv_heads=kv_heads,
                    head_size=head_size,
                    dtype=self.kv_dtype,
                    sliding_window=window,
                )
            else:
                specs[name] = FullAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=kv_heads,
                    head_size=head_size,
                    dtype=self.kv_dtype,
                )
        return specs

    def memory_budget(self) -> sim_cost.MemoryBudget:
        return sim_cost.memory_budget(
            self.shape,
            self.gpu,
            tp=self.tp,
            gpu_memory_utilization=self.cache_config.gpu_memory_utilization,
            max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens,
            max_num_seqs=self.scheduler_config.max_num_seqs,
        )

    def available_kv_cache_memory(self) -> int:
        if explicit := self.cache_config.kv_cache_memory_bytes:
            return int(explicit)
        budget = self.memory_budget()
        if budget.kv_cache_bytes <= 0:
            raise ValueError(
                f"simulated {self.gpu.name}: no memory left for the KV cache "
                f"(requested {budget.requested_bytes / 2**30:.2f} GiB, weights "
                f"{budget.weights_bytes / 2**30:.2f} GiB per rank at TP {self.tp})"
            )
        logger.info(
            "simulated %s, TP %d: weights %.2f GiB, activations %.2f GiB, other %.2f GiB; "
            "available KV cache memory %.2f GiB",
            self.gpu.name,
            self.tp,
            budget.weights_bytes / 2**30,
            budget.activation_bytes / 2**30,
            budget.other_bytes / 2**30,
            budget.kv_cache_bytes / 2**30,
        )
        return budget.kv_cache_bytes

    # --- one step ---

    def _track(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.seqs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            sp = new.sampling_params
            extra = (sp.extra_args or {}) if sp is not None else {}
            target = _length(extra.get(OUTPUT_TOKENS_KEY), new.req_id)
            prompt = new.prompt_len
            # vLLM's model runner V2 resends a resumed (preempted) request as a new one whose
            # prefill_token_ids hold the prompt and what it had generated
            total = len(new.prefill_token_ids) if new.prefill_token_ids is not None else prompt
            self.seqs[new.req_id] = _Seq(
                recompute_until=total if total > prompt else 0,
                prompt_tokens=prompt,
                output_tokens=max(0, total - prompt),
                computed_tokens=new.num_computed_tokens,
                target_tokens=target,
                eos_token_id=sp.eos_token_id if sp is not None else None,
                min_tokens=sp.min_tokens if sp is not None else 0,
                num_logprobs=sp.logprobs if sp is not None else None,
                max_tokens=sp.max_tokens if sp is not None else None,
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            seq = self.seqs.get(req_id)
            if seq is None:
                continue
            computed = cached.num_computed_tokens[i]
            if i < len(cached.num_output_tokens):
                seq.output_tokens = cached.num_output_tokens[i]
            if computed < seq.computed_tokens:  # preempted and resumed (model runner V1)
                seq.recompute_until = seq.prompt_tokens + seq.output_tokens
            seq.computed_tokens = computed

    def step(self, so: SchedulerOutput) -> ModelRunnerOutput:
        arrived = time.monotonic()
        started = time.time()
        self._track(so)
        if not so.num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT
        self.gate.acquire()
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        batch: list[sim_cost.SeqWork] = []
        max_model_len = self.model_config.max_model_len
        continues = False  # some request goes on after this step: the engine stays busy
        again: list[int] = []  # per request, the tokens it computes again (it was preempted)
        for req_id in req_ids:
            n = so.num_scheduled_tokens[req_id]
            seq = self.seqs[req_id]
            batch.append(sim_cost.SeqWork(new_tokens=n, context_tokens=seq.computed_tokens))
            again.append(min(n, max(0, seq.recompute_until - seq.computed_tokens)))
            seq.computed_tokens += n
            if seq.computed_tokens < seq.prompt_tokens + seq.output_tokens:
                sampled.append([])  # a partial prefill chunk samples nothing
                continues = True
                continue
            seq.output_tokens += 1
            ends = (
                seq.target_tokens is not None
                and seq.eos_token_id is not None
                and seq.output_tokens >= max(seq.target_tokens, seq.min_tokens, 1)
            )
            sampled.append([seq.eos_token_id if ends else self.token_id])  # type: ignore[list-item]
            continues = continues or not (
                ends
                or (seq.max_tokens is not None and seq.output_tokens >= seq.max_tokens)
                or seq.prompt_tokens + seq.output_tokens >= max_model_len
            )
        cost = self._cost(batch)
        if any(again):  # the preemptions' price: what the step costs over the batch without it
            pairs = zip(batch, again, strict=True)
            fresh = [sim_cost.SeqWork(w.new_tokens - a, w.context_tokens + a) for w, a in pairs]
            fresh = [w for w in fresh if w.new_tokens > 0]
            self.recomputed_tokens += sum(again)
            self.recompute_seconds += cost.seconds - self._cost(fresh).seconds
        seconds = self._sleep(arrived, cost.seconds)
        # a pause for a manual grant is the test's time, not the engine's CPU lag
        self._busy = continues and self.mode != "manual"
        if self._trace is not None:
            self._write_trace(so, started, seconds, batch, req_ids)
        self.simulated_seconds += seconds
        self.last_step = StepRecord(
            requests=len(req_ids),
            tokens=so.total_num_scheduled_tokens,
            sampled=sum(len(s) for s in sampled),
            seconds=seconds,
            linear_seconds=cost.linear_seconds,
            attention_seconds=cost.attention_seconds,
        )
        self.gate.finished_step()
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=self._logprobs(req_ids, sampled),
        )

    def _write_trace(
        self,
        so: SchedulerOutput,
        started: float,
        seconds: float,
        batch: list[sim_cost.SeqWork],
        req_ids: list[str],
    ) -> None:
        """One line of ``KV_SIDECAR_SIM_TRACE`` for the step just run."""
        assert self._trace is not None
        line = {
            "start": started,
            "simulated": self.simulated_seconds,
            "seconds": seconds,
            "new": [[new.req_id, new.prompt_len] for new in so.scheduled_new_reqs],
            "work": [
                [r, w.new_tokens, w.context_tokens] for r, w in zip(req_ids, batch, strict=True)
            ],
        }
        self._trace.write(json.dumps(line) + "\n")
        self._trace.flush()

    def _cost(self, batch: list[sim_cost.SeqWork]) -> sim_cost.StepCost:
        return sim_cost.step_cost(
            self.shape, self.gpu, batch, tp=self.tp, kv_dtype_bytes=self.kv_dtype_bytes
        )

    def _logprobs(self, req_ids: list[str], sampled: list[list[int]]) -> LogprobsLists | None:
        """Log-probs for the requests that asked (one row per request, as the GPU sampler
        makes them): the sampled token at log-prob 0 and rank 1, neighbours of the filler token
        as the alternatives."""
        asked = [self.seqs[r].num_logprobs for r in req_ids]
        if all(k is None for k in asked):
            return None
        # -1 asks for the whole vocabulary: capped like any other
        width = 1 + max(
            MAX_LOGPROBS if k < 0 else min(k, MAX_LOGPROBS) for k in asked if k is not None
        )
        # alternatives: ids next to the filler token, never the sampled one itself (the
        # server keys top log-probs by token id)
        ids = np.empty((len(req_ids), width), dtype=np.int64)
        logprobs = np.full((len(req_ids), width), FILLER_LOGPROB, dtype=np.float32)
        for i, tokens in enumerate(sampled):
            first = tokens[0] if tokens else self.token_id
            others = [t for t in range(self.token_id - width, self.token_id + width) if t != first]
            ids[i, 0] = first
            ids[i, 1:] = others[: width - 1]
            logprobs[i, 0] = 0.0
        ranks = np.ones(len(req_ids), dtype=np.int64)
        return LogprobsLists(ids, logprobs, ranks)

    def _sleep(self, arrived: float, model_seconds: float) -> float:
        """Sleep this step's time (times the time scale); return the simulated seconds it took.

        The engine's own CPU time between two steps (output processing, scheduling) is hidden
        behind the previous step, up to that step's wall length, as vLLM's async scheduling
        hides it on a GPU (the CPU platform turns async scheduling off): see
        ``harness.sim_cost.StepClock``.
        """
        if self.mode == "manual":
            return model_seconds
        seconds = model_seconds if self.fixed_step_seconds is None else self.fixed_step_seconds
        self.clock.pace(arrived, seconds, busy=self._busy)
        return seconds

    def state(self) -> dict[str, Any]:
        last = self.last_step.__dict__ if self.last_step is not None else None
        return {
            "mode": self.mode,
            "fixed_step_seconds": self.fixed_step_seconds,
            "gpu": self.gpu.name,
            "tensor_parallel_size": self.tp,
            "steps": self.gate.steps,
            "granted": self.gate.granted,
            "waiting": self.gate.waiting,
            "running": len(self.seqs),
            "simulated_seconds": self.simulated_seconds,
            "recomputed_tokens": self.recomputed_tokens,
            "recompute_seconds": self.recompute_seconds,
            "time_scale": self.clock.time_scale,
            "cpu_lag_seconds": self.cpu_lag_seconds,
            "cpu_lag_simulated_seconds": self.cpu_lag_seconds / self.clock.time_scale,
            "last_step": last,
        }

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()
            self._trace = None
        if self._control is not None:
            self._control.shutdown()
            self._control.server_close()
            self._control = None


def _serve_control(engine: SimEngine, address: str) -> ThreadingHTTPServer:
    host, _, port = address.rpartition(":")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/state":
                self._answer(200, engine.state())
            else:
                self._answer(404, {"error": "GET /state or POST /step"})

        def do_POST(self) -> None:
            path = self.path.rstrip("/")
            if path not in ("/step", "/mode"):
                self._answer(404, {"error": "GET /state, POST /step or POST /mode"})
                return
            length = int(self.headers.get("content-length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
                if path == "/mode":
                    if "mode" not in body and "time_scale" not in body:
                        raise KeyError("mode")
                    if "time_scale" in body:
                        engine.set_time_scale(body["time_scale"])
                    if "mode" in body:
                        engine.set_mode(str(body["mode"]))
                    self._answer(200, engine.state())
                    return
                n = int(body.get("n", 1))
                timeout = float(body.get("timeout", 30.0))
            except (ValueError, TypeError, AttributeError, KeyError) as exc:
                self._answer(400, {"error": f"bad body: {exc}"})
                return
            if engine.mode != "manual":
                self._answer(409, {"error": f"the engine steps by itself (mode {engine.mode})"})
                return
            done = engine.gate.grant(n, timeout)
            self._answer(200, {**engine.state(), "done": done})

    server = ThreadingHTTPServer((host or "127.0.0.1", int(port)), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="sim-control", daemon=True).start()
    logger.info("simulated engine control channel on http://%s", address)
    return server


class _SimWorker:
    """The worker RPC surface the engine core calls through ``collective_rpc``."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return self.engine.kv_cache_spec()

    def determine_available_memory(self) -> int:
        return self.engine.available_kv_cache_memory()

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["LBNHC"]  # vLLM's NHD, what FlashAttention uses on GPUs

    def set_kv_cache_layout(self, name: str) -> None:
        pass

    def initialize_from_config(self, kv_cache_configs: list[KVCacheConfig]) -> None:
        pass  # no tensors: the blocks exist only in the scheduler's KV-cache manager

    def compile_or_warm_up_model(self) -> None:
        return None

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def get_kv_connector_handshake_metadata(self) -> None:
        return None

    def update_max_model_len(self, max_model_len: int) -> None:
        pass

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.engine.step(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        raise RuntimeError("the simulated executor samples in execute_model")

    def take_draft_token_ids(self) -> None:
        return None

    def check_health(self) -> None:
        return None

    def synchronize_device(self) -> None:
        return None

    def reset_mm_cache(self) -> None:
        return None

    def reset_encoder_cache(self) -> None:
        return None

    def list_loras(self) -> set[int]:
        return set()

    def shutdown(self) -> None:
        self.engine.close()


class SimExecutor(Executor):
    """``--distributed-executor-backend harness.sim_executor.SimExecutor``: see the module."""

    uses_ray = False
    supports_pp = False

    def _init_executor(self) -> None:
        self.engine = SimEngine(self.vllm_config)
        self.worker = _SimWorker(self.engine)
        logger.info(
            "simulated executor: %s, TP %d, step mode %s, block size %d",
            self.engine.gpu.name,
            self.engine.tp,
            self.engine.mode,
            self.cache_config.block_size,
        )

    def collective_rpc(  # type: ignore[override]
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        single_value: bool = False,
    ) -> Any:
        kwargs = kwargs or {}
        try:
            if isinstance(method, str):
                fn = getattr(self.worker, method, None)
                if fn is None:
                    raise NotImplementedError(f"the simulated executor has no {method!r}")
                result = fn(*args, **kwargs)
            else:
                result = method(self.worker, *args, **kwargs)
            value = result if single_value else [result]
        except Exception as exc:
            if not non_block:
                raise
            failed: Future[Any] = Future()
            failed.set_exception(exc)
            return failed
        if not non_block:
            return value
        done: Future[Any] = Future()
        done.set_result(value)
        return done

    def execute_model(  # type: ignore[override]
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Any:
        return self.collective_rpc(
            "execute_model", args=(scheduler_output,), non_block=non_block, single_value=True
        )

    def sample_tokens(  # type: ignore[override]
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> Any:
        return self.collective_rpc(
            "sample_tokens", args=(grammar_output,), non_block=non_block, single_value=True
        )

    def compile_or_warm_up_model(self) -> None:
        pass

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        self.worker.shutdown()
