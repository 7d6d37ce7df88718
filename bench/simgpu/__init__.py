"""Admission at production scale, on the simulated GPU engine (uncalibrated roofline).

    python -m bench.simgpu            # about 40 minutes; progress on stderr
    python -m bench.simgpu --quick    # smoke run: smaller workloads (thrash answers of 300-500
                                      # tokens), one repetition, ~6 minutes; BENCHMARKS.md untouched
    python -m bench.simgpu --plan 8b:thrash --configs direct,sidecar-adaptive --repeat 1

vLLM's own OpenAI server, scheduler and KV-cache manager run on its CPU build with the
simulated executor (``harness.sim_vllm``, docs/simulated-engine.md): no model runs, and each
step sleeps a roofline cost for the batch on the named GPU. The engines:

- ``8b``: Llama-3.1-8B-Instruct on one H100 80 GB;
- ``70b``: Llama-3.1-70B-Instruct on eight H100 80 GB, ``--tensor-parallel-size 8`` (the
  executor sizes the pool and the step for TP 8; it runs in one process, no workers);

each with ``--max-model-len 32768 --max-num-seqs 256`` and the pool vLLM sizes at
``--gpu-memory-utilization 0.9``, unless a workload pins a smaller one to make vLLM run dry.
The workloads (lengths the sidecar never sees ride in ``vllm_xargs.sim_output_tokens``):

- ``chat``: chats without max_tokens, 200-2,000-token messages, answers of 30-600 tokens ending
  at EOS, streamed, Poisson arrivals;
- ``burst``: a ``vllm bench serve``-like random burst, 256-2,048 tokens in, 128-1,024 out
  (``max_tokens`` with ``ignore_eos``), not streamed;
- ``thrash``: 2,000-4,000-token prompts, answers of 1,500-2,500 tokens at EOS, all at once, on a
  pool that holds about half of the burst at its peak: vLLM runs dry mid-decode and preempts;
- ``thrash-long`` (not in the default plan): the same with 8,000-12,000-token prompts and
  answers of 4,000-6,000 (24 of them), where each preemption throws away a third of a second or
  more of prefill;
- ``poisson``: a Poisson stream mixing chats and random completions;
- ``priority`` (not in the default plan): a batch tenant's 200 completions at once beside an
  interactive tenant's Poisson stream of chats, on a pool pinned to 8,000 blocks (issue 23's
  workload at GPU sizes), with its own configurations: ``sidecar-alone`` (the stream alone),
  ``direct``, ``sidecar-one-tenant``, ``sidecar-classes`` (``--priority-rules``),
  ``sidecar-classes-paced`` and ``-unpaced`` (``--priority-pace`` 0.1 and 0), ``vllm-priority``,
  ``sidecar-classes-vllm-priority`` and ``sidecar-classes-paced-vllm-priority`` (on a second
  server started with ``--scheduling-policy priority``, the classes forwarded with
  ``--forward-priority``).

Configurations, interleaved on the same engine in a rotating order: ``direct`` (vLLM alone),
``sidecar-adaptive`` (the sidecar's defaults: adaptive reservations) and
``sidecar-worst-case``. Every engine runs at a time scale (``--sim-time-scale``: each step
sleeps that many times its cost, arrivals and the sidecar's timers stretched alike) chosen so
that this machine's CPU does not set the clock; figures are reported in simulated GPU seconds.
Writes ``bench/results/simgpu-raw.json`` (every request, every sample), the summary
``bench/results/simgpu.json`` and the simgpu section of BENCHMARKS.md (a full run only)."""
