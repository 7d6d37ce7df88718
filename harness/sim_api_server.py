"""vLLM's OpenAI server as ``harness.sim_vllm`` runs it: :func:`as_gpu_host` first, then
``vllm.entrypoints.openai.api_server`` as ``python -m`` would run it.

vLLM's CPU platform turns chunked prefill and prefix caching off for an MLA model, and sets
``max_num_batched_tokens`` to the context length, unless the host CPU has Intel's AMX tiles
(``vllm/platforms/cpu.py``, ``check_and_update_config``: its reference MLA kernel cannot chunk).
No model runs on the simulated engine, and on a GPU vLLM keeps both, so the simulation answers
that check as an AMX host does, on any host (an AMD host would otherwise serve an MLA model with
no prefix caching and 32k-token steps).
"""

from __future__ import annotations

import runpy


def as_gpu_host() -> None:
    """Make vLLM's CPU platform keep chunked prefill and prefix caching for MLA models, as on a
    GPU: report AMX tiles present (checked only by the CPU platform's kernel choices, which the
    simulated executor never runs)."""
    import torch

    torch.cpu._is_amx_tile_supported = lambda: True


if __name__ == "__main__":
    as_gpu_host()
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
