"""GPUs the simulated engine can pretend to be: the sidecar's table (``sidecar.kv.gpus``).

One source of truth: ``kv-sidecar plan --gpu NAME`` and the simulated engine read the same
figures (memory as the CUDA driver reports it, memory bandwidth, dense bf16 compute, vLLM's batch
defaults), each with its source in ``sidecar.kv.gpus``. Imported by the cost model
(``harness.sim_cost``), the simulated executor (``harness.sim_executor``, inside the vLLM venv:
``sidecar.kv.gpus`` needs nothing beyond the standard library, and importing it runs only the
two-line ``sidecar/__init__.py`` and the empty ``sidecar/kv/__init__.py`` besides) and the tests.

>>> gpu("h100").memory_gib
79.6474609375
"""

from __future__ import annotations

from sidecar.kv.gpus import ALIASES, GIB, GPUS, MIB, GpuSpec, batch_defaults, gpu

__all__ = ["ALIASES", "GIB", "GPUS", "MIB", "GpuSpec", "batch_defaults", "gpu"]
