"""The owner's event loop under load (issue 19): ``python -m bench.owner_loop``.

A sidecar with relay workers (``kv-sidecar serve --workers 2``) in front of the fast fake vLLM,
driven by an open-loop Poisson stream of requests (500/s by default) whose durations hold about
2,000 in flight (Little's law): streamed completions paced slowly (a few events each, so that
the relay is not what is measured) and non-streamed ones. Over a measured window after a ramp it
reads the owner's ``kv_sidecar_event_loop_lag_seconds`` histogram (a timer due every 100 ms on
the owner's loop, observed at each wake-up) before and after, and reports from the bucket
deltas: the probes, the share within 5 ms (the p99 is under 5 ms exactly when at least 99% of
the probes are in the ``le=0.005`` bucket), p50 and p99 interpolated within their buckets, and
the largest bucket reached; beside them the arrival rate achieved, the requests completed, the
in flight (the sidecar's ``/state``, sampled), errors and 429s, and the CPU seconds of the owner,
the workers, the fake vLLM and the client over the window (``/proc``), with the load average.

    python -m bench.owner_loop                    # 500/s, 2,000 in flight, 60 s window
    python -m bench.owner_loop --rate 300 --seconds 30 --no-report
    python -m bench.owner_loop --quick            # smoke run: 100/s, 200 in flight, 10 s

The client is raw asyncio on uvloop in a process of its own (``--clients N`` splits the rate
over N of them), so that its CPU is counted apart from the sidecar's. Writes
``bench/results/owner-loop.json`` and the ``owner_loop`` section of BENCHMARKS.md.
"""
