"""Two vLLM replicas behind nginx (or HAProxy): what the sidecars change for a fleet.

    python -m bench.fleet                # 3 interleaved repetitions (about an hour)
    python -m bench.fleet --quick        # small burst, 1 repetition (a smoke run)
    python -m bench.fleet --report-only  # figures, charts and report from fleet-raw.json
    python -m bench.fleet --engine sim-8b  # two simulated 8B replicas, an H100 each

Two vLLM servers (CPU build, the generated model, a small KV pool each) sit behind one nginx,
the engine of ingress-nginx, that spreads requests over them by weighted round-robin (weight 3
for replica A, 1 for replica B: the arrivals are uneven) and retries the other replica on
``error timeout http_429 http_503 non_idempotent`` with ``proxy_next_upstream_tries 2``. The
same skewed burst of long streamed completions (more of them than one replica's pool holds, all
sent at once) goes through these configurations:

- ``direct``: nginx straight to the two vLLMs;
- ``sidecar-queue``: nginx to one sidecar per vLLM, ``--policy queue`` (a request that does not
  fit waits in its replica's sidecar);
- ``sidecar-reject``: nginx to one sidecar per vLLM, ``--policy reject``: a refused request is
  sent by nginx to the other replica; when both refuse, the client gets the 429 and retries after
  its ``retry-after-ms`` / ``Retry-After`` (at most ``MAX_ATTEMPTS`` attempts);
- ``sidecar-spill-S`` (S in ``SPILL_WAITS``: 2, 5 and 15): nginx to one sidecar per vLLM,
  ``--policy spill --spill-wait S``: a request whose expected wait there is at most S seconds
  queues, a longer one is refused at once and nginx tries the other replica, as under reject;
- ``sidecar-queue-haproxy``: HAProxy instead of nginx (``bench/fleet/haproxy.py``), on
  ``deploy/gateway/haproxy.cfg`` as shipped but for its bind address, stats socket, an
  ``x-bench-id`` capture for its log and its servers (three of weight 100 for replica A, one for
  B: 3:1 as nginx's), to one sidecar per vLLM with ``--policy queue`` and its agent on
  (``--agent-port``): HAProxy asks each agent every second and sets the server's weight to the
  share of the KV budget left free; it retries a 503 or a failed connection once, never a 429;
- ``sidecar-spill-2-haproxy``: the same behind HAProxy, with the sidecars on ``--policy spill
  --spill-wait 2 --spill-status 503`` (a spilled request, at arrival or handed back from the
  queue, is answered 503, which HAProxy retries once on another server).

``--engine sim-8b`` runs the replicas on the simulated Llama-3.1-8B (``harness.sim_vllm``), an
H100 each, 4 times slower than simulated: on the CPU build the two replicas share this machine's
cores, so work moved from one to the other is not work done beside it; the burst there is 48
completions of 2,000 prompt tokens and 600 output tokens on pools of 3,000 blocks of 16
(``bench.fleet.run.ENGINES``), the sidecars' scrape, staleness and spill wait stretched by the
time scale, and results are named with ``-sim-8b``.

The nginx configuration is the same in all the nginx ones (the retry directives only act on 429,
503 and errors). Figures per replica: vLLM's preemptions, requests served (nginx's access log, or
HAProxy's httplog: the upstream that answered 200), generated tokens (vLLM's counter), TTFT and
end-to-end p50/p99 of the answers it served, vLLM's queue time and the sidecar's queue wait. Per
configuration: goodput (completed output tokens per second from the burst to the last answer),
TTFT and E2E p50/p99 over every answer of a repetition, the 429s the client saw, the 429s nginx
absorbed by retrying the other replica, every answer's wait before its first token (counted from
the client's first attempt: queueing, refusals and sleeps included), the 429s whose Retry-After
was at the sidecar's cap (``MAX_RETRY_AFTER``) and of those the ones refused while the other
replica's sidecar had room (its budget less committed blocks less its queue's peaks, in the
nearest 0.5 s sample of /state, held the request's peak), and HAProxy's weights per replica
(``show stat`` every 0.5 s). Each configuration runs ``--repeat`` times, interleaved in a
rotating order; the report gives medians over repetitions and every repetition's value.

Writes ``bench/results/fleet-raw.json`` (every request, every gateway log line, every sample),
``bench/results/fleet.json`` (figures), ``bench/results/fleet-timeline.png`` and
``fleet-summary.png``, and the fleet section of ``BENCHMARKS.md`` (full runs only).
"""

# The package: ``run`` is the fleet (two vLLMs, their sidecars, nginx or HAProxy) and the client's
# burst, ``haproxy`` the HAProxy configuration, process and log, ``figures`` reads the outcomes
# and the gateway's log into figures, ``report`` draws the charts and writes the section, ``cli``
# is the command line (``python -m bench.fleet``).
