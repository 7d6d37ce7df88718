"""``python -m bench.upstream``: the fast fake vLLM under its old name.

The fake itself is :mod:`harness.fake_vllm_fast` (the tests' :class:`~harness.fake_vllm.FakeVllm`
at loopback speed); the benchmarks start it with ``FakeVllmProcess``. This name stays only for
``deploy/tools/cpu_per_request.py``, which runs ``python -m bench.upstream``; the same flags work.
"""

from harness.fake_vllm_fast import main

if __name__ == "__main__":
    main()
