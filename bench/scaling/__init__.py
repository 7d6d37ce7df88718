"""How the sidecar's CPU per request scales: with connections, with prompt length and with the
requests it holds in flight. The figures size its Kubernetes CPU request (deploy/README.md).

    python -m bench.scaling              # about 8 minutes; bench/results/scaling.json and .png
    python -m bench.scaling --quick      # a smoke run (fewer points, one short round)
    python -m bench.scaling --workers 2  # also a sidecar with 2 relay workers on curve 1

Set-up, every part its own process on one machine: the fast fake vLLM (``harness.fake_vllm_fast``,
``--max-model-len 200000`` so that 128k-token prompts are not refused, a KV pool of 1,000,000
blocks), one ``kv-sidecar serve`` in front of it with its default flags (``--log-level
warning``; one process, counting prompts with the model's local tokenizer, discovered from
``/v1/models`` ``root``), and the load generators. The CPU figures are the sidecar process's
(all its threads: long prompts are tokenized on worker threads with the GIL released) read from
``/proc`` before and after each run, divided by the requests it served; ``direct`` is the same
load sent straight to the fake, for its requests/s and the fake's own CPU per request.

1. **Connections**: small non-streamed completions (``bench.overhead``'s ~20-token prompt,
   ``max_tokens`` 16) from ``wrk -t1`` at 1 to 64 connections.
2. **Prompt length**: completions of about 1k, 8k, 32k and 128k tokens (``bench.counting``'s
   generated texts, four distinct ones per length, sent in turn), ``max_tokens`` 1, at 1 and 4
   connections, from a light closed-loop client (its own process) that finishes every request it
   starts, so that no half-counted prompt is charged to the window. Per request and per prompt
   token (the sidecar's own count, ``kv_sidecar_prompt_tokens_total``).
3. **Requests in flight**: N slow SSE streams held open through the sidecar (a light client
   process; ``max_tokens`` 10,000, paced by the fake at one event per 100 ms; every one admitted,
   checked on ``/state``), first alone (their own cost, N = 0: the idle cost), then with ``wrk``
   sending small requests at 8 connections beside them: the CPU per small request with the
   streams' rate subtracted, and the mean admission decision time over that window
   (``kv_sidecar_decision_seconds`` sum and count deltas).

Rounds interleave the points (their order rotates each round); figures are medians over rounds.
"""

# The package: ``clients`` are the light load generators (each its own process, run as
# ``python -m bench.scaling --send`` / ``--hold-streams``), ``run`` starts the processes and
# measures the three curves, ``figures`` turns the rounds into medians and the deploy
# arithmetic, ``report`` draws the chart and writes the section, ``cli`` is the command line.
