"""Proxy overhead on loopback: what the sidecar adds to every request, against going direct and
against nginx as a plain reverse proxy, all measured in the same run.

    python -m bench.overhead            # about 9 minutes; writes bench/results/overhead.json
    python -m bench.overhead --quick    # fewer, shorter rounds (a smoke run)

Set-up (every part a separate process): the fast fake vLLM (``harness.fake_vllm_fast``) speaking
vLLM's formats; in front of it, the sidecar (``--log-level warning``) counting prompts with the
model's local tokenizer (the realistic set-up: discovered from ``/v1/models`` ``root``), a second
sidecar that counts with the upstream's ``/tokenize`` (no local tokenizer), and Debian's nginx as
a plain reverse proxy (one worker, keep-alive upstream, buffering off), and a plain uvicorn relay
(``bench.proxies``) on three HTTP clients: httpx on its default transport, httpx on the sidecar's
own transport, and aiohttp (the client production-stack's router relays with). Load comes from
``wrk`` (plain JSON requests) and ``bench.sse_client`` (SSE streams), each its own process.

Rounds interleave the paths (the order rotates each round) and the figures are medians over the
rounds, so that the noise of a shared machine hits every path alike; ratios are taken within each
round before the median.
"""

# The package: ``run`` starts the paths and measures them (the workload is wrk's and
# bench.sse_client's), ``report`` turns the rounds into figures and the BENCHMARKS.md section,
# ``cli`` is the command line (``python -m bench.overhead``).
