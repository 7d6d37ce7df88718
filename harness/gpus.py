"""GPUs the simulated engine can pretend to be: memory, HBM bandwidth and dense bf16 compute.

Pure data, no I/O; imported by the cost model (``harness.sim_cost``), the simulated executor
(``harness.sim_executor``, inside the vLLM venv) and the tests, so it needs nothing beyond the
standard library.

Sources (the vendor's datasheets, peak figures; bf16 is the *dense* tensor-core rate, half the
"with sparsity" figure the datasheets print):

- H100 SXM5 80 GB: NVIDIA H100 Tensor Core GPU datasheet: HBM3 3.35 TB/s, BF16 Tensor Core
  1,979 TFLOPS with sparsity, so 989.4 dense.
- H200 SXM 141 GB: NVIDIA H200 Tensor Core GPU datasheet: HBM3e 4.8 TB/s, BF16 Tensor Core
  1,979 TFLOPS with sparsity (the same Hopper compute as the H100 SXM), 989.4 dense.
- A100 SXM4 80 GB: NVIDIA A100 Tensor Core GPU datasheet: HBM2e 2,039 GB/s, BF16 Tensor Core
  312 TFLOPS dense (624 with sparsity).

``memory_bytes`` is the total the CUDA driver reports (``cudaMemGetInfo``, ``nvidia-smi``'s
"MiB" total), which is what vLLM multiplies by ``--gpu-memory-utilization``: 81,559 MiB on an
H100 80 GB HBM3, 143,771 MiB on an H200, 81,920 MiB on an A100 80 GB, as public ``nvidia-smi``
logs of those boards show. It is less than the marketing "80 GB"/"141 GB" (the driver keeps some).

>>> GPUS["h100-80gb"].memory_gib
79.6474609375
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class GpuSpec:
    """One GPU as the cost model sees it (peak figures; efficiencies live in the cost model)."""

    name: str
    memory_bytes: int
    hbm_bytes_per_second: float
    bf16_dense_flops_per_second: float
    #: vLLM's batch defaults for the OpenAI server on this GPU (``EngineArgs.get_batch_defaults``
    #: in vLLM 0.32: >= 70 GiB and not an A100: 8,192 tokens and 1,024 sequences; >= 160 GiB:
    #: 16,384 and 1,024; otherwise 2,048 and 256). The simulated engine runs on vLLM's CPU
    #: platform, whose own defaults (2,048 x TP and 128 x TP) would otherwise apply.
    default_max_num_batched_tokens: int
    default_max_num_seqs: int
    #: NVLink bandwidth per GPU, both directions summed as the datasheets give it (H100/H200 SXM:
    #: 900 GB/s; A100 SXM: 600 GB/s). Tensor parallel's all-reduces cross it.
    nvlink_bytes_per_second: float = 900e9

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB


GPUS: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        GpuSpec(
            name="h100-80gb",
            memory_bytes=81_559 * MIB,
            hbm_bytes_per_second=3.35e12,
            bf16_dense_flops_per_second=989.4e12,
            default_max_num_batched_tokens=8192,
            default_max_num_seqs=1024,
        ),
        GpuSpec(
            name="h200-141gb",
            memory_bytes=143_771 * MIB,
            hbm_bytes_per_second=4.8e12,
            bf16_dense_flops_per_second=989.4e12,
            default_max_num_batched_tokens=8192,
            default_max_num_seqs=1024,
        ),
        GpuSpec(
            name="a100-80gb",
            memory_bytes=81_920 * MIB,
            hbm_bytes_per_second=2.039e12,
            bf16_dense_flops_per_second=312e12,
            default_max_num_batched_tokens=2048,
            default_max_num_seqs=256,
            nvlink_bytes_per_second=600e9,
        ),
    )
}

#: Other spellings accepted on the command line.
ALIASES = {"h100": "h100-80gb", "h200": "h200-141gb", "a100": "a100-80gb"}


def gpu(name: str) -> GpuSpec:
    """The spec named ``name`` (case-insensitive; ``h100`` for ``h100-80gb`` and so on)."""
    key = name.lower()
    key = ALIASES.get(key, key)
    try:
        return GPUS[key]
    except KeyError:
        known = ", ".join(sorted(GPUS))
        raise ValueError(f"unknown GPU {name!r} (known: {known})") from None
