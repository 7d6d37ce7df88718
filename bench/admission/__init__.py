"""Admission quality on the real vLLM (CPU build, generated model, 64 KV blocks of 128 tokens).

    python -m bench.admission            # about 45 minutes; progress on stderr
    python -m bench.admission --quick    # smaller workloads (a smoke run)
    python -m bench.admission --workloads burst --configs direct,sidecar-worst-case-queue
    python -m bench.admission --workloads priority --repeat 2   # priority classes, tenants

Six workloads, each sent unchanged to every configuration in the same run:

- ``burst``: long prompts with large ``max_tokens`` all at once (``ignore_eos``: every answer runs
  to ``max_tokens``);
- ``poisson``: an open-loop Poisson mix of short and long completions whose real answers end well
  before ``max_tokens`` (the real length is drawn per request; the bench-only shim
  ``bench.proxies shim`` placed just in front of vLLM cuts each answer there, see its docstring);
- ``chat``: multi-turn chats that share one long system prompt, where vLLM's prefix cache matters;
- ``no-max-tokens``: chats and completions that name no ``max_tokens`` (vLLM: the rest of the
  context for a chat, cut early by the shim; 16 for a completion);
- ``staggered``: long answers arriving spread out over time, each running to ``max_tokens``: the
  sum of their peaks is far above the pool, the peak of their sum is not;
- ``mixed``: request classes mixed: short chats with a small ``max_tokens``, long completions,
  absent ``max_tokens``, ``n`` 2, a quarter of the requests not streamed.

Configurations: vLLM direct; vLLM with its own limits tuned (``--max-num-seqs``,
``--max-num-queued-reqs``: a second server); vLLM with its own ``--watermark 0.05`` (a third
server); a utilization-threshold shedder like the inference gateway's default
(``bench.proxies shedder``); the sidecar with ``--reservation worst-case``, ``expected``
and ``adaptive``, each with ``--policy queue`` and ``reject``; the sidecar with
``--policy observe`` (it relays and accounts but gates nothing: what the relay alone costs);
and ``oracle``: the sidecar in worst-case mode (queue)
whose clients name every request's real answer length as its ``max_tokens``, so that worst case
is exact: the best any reservation can do. Clients retry 429 and 503 the way the official openai
client does: after ``retry-after-ms`` / ``Retry-After`` when given, else with exponential backoff
(0.5 s doubling to 8 s); latencies count from the first attempt.

Figures per configuration: vLLM preemptions, requests completed, refused answers and requests that
retried, goodput (completed output tokens per second over the whole run) against direct and the
oracle, p50/p99 time to first token and end to end, the sidecar's signed prediction error (its
ledger against vLLM's reported blocks at each scrape: mean, p5, p95, min, max over every sample of
every repetition, and the mean absolute error per running request; samples that under-predict by
2 blocks or more are kept with their context), reserved over used blocks, and the KV utilization
vLLM achieved. Writes ``bench/results/admission.json``, one PNG per workload in
``bench/results/``, and the admission section of ``BENCHMARKS.md`` (only from a full run with
every configuration).

``--workloads priority`` (run on its own) is issue 23's measurement: a batch tenant's burst of
long completions beside an interactive tenant's Poisson stream of short chats, each naming its
tenant in ``x-kv-sidecar-tenant``, on its own configurations: the interactive stream alone
through the sidecar, vLLM direct (FCFS), a second vLLM started with ``--scheduling-policy
priority`` with the ``priority`` field in each body, and the sidecar with one tenant, with two
tenants and no classes, and with ``--priority-rules tenant:batch=10`` (adaptive and worst-case).
Figures per class (interactive TTFT p50/p99 and goodput, batch goodput) with preemptions and
refusals; writes ``bench/results/admission-priority.json`` (raw: ``admission-priority-raw.json``)
and the admission-priority section of ``BENCHMARKS.md``."""

# The package: ``workload`` holds the six workloads and the configurations they run on,
# ``client`` sends a workload and samples vLLM and the sidecar meanwhile, ``run`` runs one
# configuration on one workload, ``figures``, ``chart`` and ``report`` turn the raw runs into the
# results, ``cli`` is the command line (``python -m bench.admission``).
