"""GPUs by name: memory as the CUDA driver reports it, memory bandwidth, dense bf16 compute.

The one table of GPUs: ``kv-sidecar plan --gpu NAME`` sizes vLLM's KV cache from it, and the
simulated engine (``harness.gpus`` re-exports this module; ``harness.sim_executor`` runs inside
vLLM's own venv) prices its steps from it. Pure data, no I/O, nothing beyond the standard
library.

Sources (the vendor's datasheets, peak figures; bf16 is the *dense* tensor-core rate, half the
"with sparsity" figure the datasheets print):

- H100 SXM5 80 GB: NVIDIA H100 Tensor Core GPU datasheet: HBM3 3.35 TB/s, BF16 Tensor Core
  1,979 TFLOPS with sparsity, so 989.4 dense; NVLink 900 GB/s.
- H200 SXM 141 GB: NVIDIA H200 Tensor Core GPU datasheet: HBM3e 4.8 TB/s, BF16 Tensor Core
  1,979 TFLOPS with sparsity (the same Hopper compute as the H100 SXM), 989.4 dense; NVLink
  900 GB/s.
- A100 SXM4 80 GB: NVIDIA A100 Tensor Core GPU datasheet: HBM2e 2,039 GB/s, BF16 Tensor Core
  312 TFLOPS dense (624 with sparsity); NVLink 600 GB/s.
- A100 SXM4 40 GB: the same datasheet: HBM2 1,555 GB/s, BF16 312 TFLOPS dense, NVLink 600 GB/s.
- L40S 48 GB: NVIDIA L40S datasheet: GDDR6 864 GB/s, BF16 Tensor Core 362.05 TFLOPS dense (733
  with sparsity); no NVLink: PCIe Gen4 x16, 64 GB/s bidirectional.
- L4 24 GB: NVIDIA L4 Tensor Core GPU datasheet: GDDR6 300 GB/s, BF16 Tensor Core 242 TFLOPS
  with sparsity, so 121 dense; no NVLink: PCIe Gen4 x16, 64 GB/s bidirectional.

``memory_bytes`` is the total the CUDA driver reports (``cudaMemGetInfo``, ``nvidia-smi``'s
"MiB" total), which is what vLLM multiplies by ``--gpu-memory-utilization``. It is less than
the marketing "80 GB"/"141 GB"/"48 GB" (the driver keeps some, and ECC on GDDR6 boards takes
its share). The figures are those public ``nvidia-smi`` logs of each board show with ECC on,
their default in data centres: 81,559 MiB on an H100 80 GB HBM3, 143,771 MiB on an H200,
81,920 MiB on an A100 80 GB, 40,960 MiB on an A100 40 GB (SXM4 and PCIe alike), 46,068 MiB on
an L40S and 23,034 MiB on an L4. A board with ECC off, a different VBIOS or a MIG slice reports
otherwise: ``--gpu-memory-gib`` takes the figure ``nvidia-smi`` shows there.

>>> GPUS["h100-80gb"].memory_gib
79.6474609375
>>> gpu("L40S").name
'l40s-48gb'
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
GIB = 1 << 30

#: PCIe Gen4 x16, both directions summed as the datasheets give it (the L40S and L4 have no
#: NVLink; tensor parallel's all-reduces cross PCIe there).
PCIE_GEN4_X16_BYTES_PER_SECOND = 64e9


@dataclass(frozen=True)
class GpuSpec:
    """One GPU: its memory as the driver reports it and its peak figures."""

    name: str
    memory_bytes: int
    hbm_bytes_per_second: float  # device memory bandwidth (HBM, or GDDR6 on the L40S and L4)
    bf16_dense_flops_per_second: float
    #: vLLM's batch defaults for the OpenAI server on this GPU (``EngineArgs.get_batch_defaults``
    #: in vLLM 0.32: >= 160 GiB: 16,384 tokens and 1,024 sequences; >= 70 GiB and not an A100:
    #: 8,192 and 1,024; otherwise 2,048 and 256). The simulated engine runs on vLLM's CPU
    #: platform, whose own defaults (2,048 x TP and 128 x TP) would otherwise apply.
    default_max_num_batched_tokens: int
    default_max_num_seqs: int
    #: NVLink bandwidth per GPU, both directions summed as the datasheets give it (H100/H200 SXM:
    #: 900 GB/s; A100 SXM: 600 GB/s); PCIe's on boards without NVLink. Tensor parallel's
    #: all-reduces cross it.
    nvlink_bytes_per_second: float = 900e9
    #: what the datasheet calls the board, for plan's output
    label: str = ""

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
            label="NVIDIA H100 SXM5 80 GB",
        ),
        GpuSpec(
            name="h200-141gb",
            memory_bytes=143_771 * MIB,
            hbm_bytes_per_second=4.8e12,
            bf16_dense_flops_per_second=989.4e12,
            default_max_num_batched_tokens=8192,
            default_max_num_seqs=1024,
            label="NVIDIA H200 SXM 141 GB",
        ),
        GpuSpec(
            name="a100-80gb",
            memory_bytes=81_920 * MIB,
            hbm_bytes_per_second=2.039e12,
            bf16_dense_flops_per_second=312e12,
            default_max_num_batched_tokens=2048,
            default_max_num_seqs=256,
            nvlink_bytes_per_second=600e9,
            label="NVIDIA A100 SXM4 80 GB",
        ),
        GpuSpec(
            name="a100-40gb",
            memory_bytes=40_960 * MIB,
            hbm_bytes_per_second=1.555e12,
            bf16_dense_flops_per_second=312e12,
            default_max_num_batched_tokens=2048,
            default_max_num_seqs=256,
            nvlink_bytes_per_second=600e9,
            label="NVIDIA A100 SXM4 40 GB",
        ),
        GpuSpec(
            name="l40s-48gb",
            memory_bytes=46_068 * MIB,
            hbm_bytes_per_second=864e9,
            bf16_dense_flops_per_second=362.05e12,
            default_max_num_batched_tokens=2048,
            default_max_num_seqs=256,
            nvlink_bytes_per_second=PCIE_GEN4_X16_BYTES_PER_SECOND,
            label="NVIDIA L40S 48 GB (PCIe)",
        ),
        GpuSpec(
            name="l4-24gb",
            memory_bytes=23_034 * MIB,
            hbm_bytes_per_second=300e9,
            bf16_dense_flops_per_second=121e12,
            default_max_num_batched_tokens=2048,
            default_max_num_seqs=256,
            nvlink_bytes_per_second=PCIE_GEN4_X16_BYTES_PER_SECOND,
            label="NVIDIA L4 24 GB (PCIe)",
        ),
    )
}

#: Other spellings accepted on the command line.
ALIASES = {
    "h100": "h100-80gb",
    "h200": "h200-141gb",
    "a100": "a100-80gb",
    "l40s": "l40s-48gb",
    "l4": "l4-24gb",
}


def gpu(name: str) -> GpuSpec:
    """The spec named ``name`` (case-insensitive; ``h100`` for ``h100-80gb`` and so on).

    An unknown name raises :class:`ValueError` naming the known ones.
    """
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    try:
        return GPUS[key]
    except KeyError:
        known = ", ".join(sorted(GPUS))
        aliases = ", ".join(sorted(ALIASES))
        raise ValueError(f"unknown GPU {name!r} (known: {known}; or {aliases})") from None


def batch_defaults(memory_bytes: int, *, a100: bool = False) -> tuple[int, int]:
    """vLLM 0.32's OpenAI-server defaults (max_num_batched_tokens, max_num_seqs) for a GPU of
    ``memory_bytes`` (``EngineArgs.get_batch_defaults``); ``a100``: its name says A100.

    >>> batch_defaults(GPUS["h100-80gb"].memory_bytes), batch_defaults(24 * GIB)
    ((8192, 1024), (2048, 256))
    """
    if memory_bytes >= 160 * GIB:
        return 16384, 1024
    if memory_bytes >= 70 * GIB and not a100:
        return 8192, 1024
    return 2048, 256
