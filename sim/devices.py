"""The device catalog: datasheet peak compute, memory bandwidth and capacity of each accelerator.

These are the numbers a roofline model uses when no calibration profile exists. Every entry says
where its numbers come from. Conventions, so that entries compare:

- Peak FLOP/s are **dense** (no 2:4 structured sparsity) and at boost clock.
- ``fp16`` and ``bf16`` are tensor-core rates **with FP32 accumulate**, because that is what
  PyTorch asks cuBLAS for (``CUBLAS_COMPUTE_32F``) in a half-precision matmul. On GeForce parts
  this is half the "FP16 accumulate" figure that marketing tables lead with.
- ``fp32`` is the plain FP32 (CUDA core) rate, not TF32: PyTorch disables TF32 for matmuls by
  default (``torch.backends.cuda.matmul.allow_tf32 = False``).
- Bandwidths are decimal, as in the datasheets (1 TB/s = 1e12 bytes/s). Memory capacities are
  binary: a datasheet's "80GB" of HBM or "12GB" of GDDR6 is built from power-of-two chips and
  is 80 GiB / 12 GiB (what ``nvidia-smi`` reports, before the driver's reservation).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from models.errors import ConfigError
from sim.vocabulary import Accumulation


@dataclass(frozen=True)
class DeviceSpec:
    """Datasheet figures of one kind of device.

    Attributes:
        name: catalog key, as written in a cluster description (``type: h100_sxm``).
        description: product name and variant.
        peak_flops_per_s: dense peak FLOP/s keyed by dtype name (``"fp32"``, ``"fp16"``,
            ``"bf16"``); a dtype the device cannot run fast is absent.
        memory_bandwidth_bytes_per_s: peak device-memory bandwidth, bytes/s.
        memory_capacity_bytes: device memory, bytes.
        source: where the numbers come from (datasheet title and URL, or the derivation).
        core_peak_flops_per_s: for a CPU, one core's peak FLOP/s per dtype (None: not a CPU).
        core_memory_bandwidth_bytes_per_s: for a CPU, the memory bandwidth one core reaches
            alone, bytes/s (None: not a CPU). Both a single-threaded rank's (:meth:`one_core`).
        fp16_accumulate_flops_per_s: dense fp16 tensor FLOP/s with fp16 accumulation where it
            differs from ``peak_flops_per_s["fp16"]`` (GeForce parts: twice; None: the same,
            :class:`sim.vocabulary.Accumulation`).
    """

    name: str
    description: str
    peak_flops_per_s: Mapping[str, float]
    memory_bandwidth_bytes_per_s: float
    memory_capacity_bytes: int
    source: str
    core_peak_flops_per_s: Mapping[str, float] | None = None
    core_memory_bandwidth_bytes_per_s: float | None = None
    fp16_accumulate_flops_per_s: float | None = None

    def __post_init__(self) -> None:
        # A read-only view keeps the frozen spec immutable all the way down.
        object.__setattr__(self, "peak_flops_per_s", MappingProxyType(dict(self.peak_flops_per_s)))
        if self.core_peak_flops_per_s is not None:
            object.__setattr__(self, "core_peak_flops_per_s", MappingProxyType(dict(self.core_peak_flops_per_s)))

    def peak_flops(self, dtype: str, field: str = "dtype", accumulation: Accumulation = Accumulation.FP32) -> float:
        """Dense peak FLOP/s for ``dtype``; for fp16 products that ``accumulation`` says accumulate
        in fp16 (:class:`sim.vocabulary.Accumulation`), :attr:`fp16_accumulate_flops_per_s` where
        the device has it.

        Raises:
            ConfigError: (on ``field``) if the device has no rate for that dtype, e.g. bf16 on a T4.
        """
        if dtype == "fp16" and accumulation == Accumulation.FP16 and self.fp16_accumulate_flops_per_s is not None:
            return self.fp16_accumulate_flops_per_s
        try:
            return self.peak_flops_per_s[dtype]
        except KeyError:
            known = ", ".join(self.peak_flops_per_s)
            problem = f"device {self.name!r} does not support this dtype; it supports: {known}"
            raise ConfigError(field, f"{problem} (got {dtype!r})") from None

    def one_core(self) -> tuple[Mapping[str, float], float]:
        """(peak FLOP/s per dtype, memory bandwidth in bytes/s) of one of a CPU's cores: what a
        single-threaded rank reaches (the reference runtime runs every CPU rank with one torch
        thread, ``runtime/launch.py``); a device without per-core figures (an accelerator) whole."""
        if self.core_peak_flops_per_s is None or self.core_memory_bandwidth_bytes_per_s is None:
            return self.peak_flops_per_s, self.memory_bandwidth_bytes_per_s
        return self.core_peak_flops_per_s, self.core_memory_bandwidth_bytes_per_s


_T = 1e12
_GB = 1e9
_GIB = 2**30

DEVICES: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        DeviceSpec(
            name="h100_sxm",
            description="NVIDIA H100 SXM5 80GB",
            peak_flops_per_s={"fp32": 67 * _T, "fp16": 989.4 * _T, "bf16": 989.4 * _T},
            memory_bandwidth_bytes_per_s=3.35e12,
            memory_capacity_bytes=80 * _GIB,
            source=(
                "NVIDIA H100 Tensor Core GPU datasheet, SXM column "
                "(https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet): "
                "FP32 67 TFLOPS; BF16/FP16 Tensor Core 1,979 TFLOPS with sparsity, halved for dense; "
                "TF32 would be 494.7 dense; 80 GB HBM3 at 3.35 TB/s"
            ),
        ),
        DeviceSpec(
            name="a100_80gb",
            description="NVIDIA A100 SXM4 80GB",
            peak_flops_per_s={"fp32": 19.5 * _T, "fp16": 312 * _T, "bf16": 312 * _T},
            memory_bandwidth_bytes_per_s=2.039e12,
            memory_capacity_bytes=80 * _GIB,
            source=(
                "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column "
                "(https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): FP32 19.5 TFLOPS; "
                "BF16/FP16 Tensor Core 312 TFLOPS dense (624 sparse); 80 GB HBM2e at 2,039 GB/s"
            ),
        ),
        DeviceSpec(
            name="a100_80gb_pcie",
            description="NVIDIA A100 PCIe 80GB",
            peak_flops_per_s={"fp32": 19.5 * _T, "fp16": 312 * _T, "bf16": 312 * _T},
            memory_bandwidth_bytes_per_s=1.935e12,
            memory_capacity_bytes=80 * _GIB,
            source=(
                "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB PCIe column "
                "(https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): FP32 19.5 TFLOPS; "
                "BF16/FP16 Tensor Core 312 TFLOPS dense (624 sparse); 80 GB HBM2e at 1,935 GB/s; "
                "no NVLink switch: its peers are reached over PCIe (an NVLink bridge joins pairs only)"
            ),
        ),
        DeviceSpec(
            name="rtx_4090",
            description="NVIDIA GeForce RTX 4090 24GB",
            peak_flops_per_s={"fp32": 82.6 * _T, "fp16": 165.2 * _T, "bf16": 165.2 * _T},
            fp16_accumulate_flops_per_s=330.3 * _T,
            memory_bandwidth_bytes_per_s=1008 * _GB,
            memory_capacity_bytes=24 * _GIB,
            source=(
                "NVIDIA Ada GPU Architecture whitepaper v2.1, Appendix A, RTX 4090 "
                "(https://images.nvidia.com/aem-dam/Solutions/geforce/ada/"
                "nvidia-ada-gpu-architecture.pdf): FP16/BF16 Tensor with FP32 accumulate "
                "165.2 TFLOPS dense (330.3 is the FP16-accumulate figure, which PyTorch does not "
                "use); FP32 82.6 TFLOPS; 24 GB GDDR6X at 1,008 GB/s"
            ),
        ),
        DeviceSpec(
            name="rtx_3090",
            description="NVIDIA GeForce RTX 3090 24GB (GA102, 82 SMs, 1.695 GHz boost)",
            peak_flops_per_s={"fp32": 35.6 * _T, "fp16": 71 * _T, "bf16": 71 * _T},
            fp16_accumulate_flops_per_s=142 * _T,
            memory_bandwidth_bytes_per_s=936 * _GB,
            memory_capacity_bytes=24 * _GIB,
            source=(
                "NVIDIA Ampere GA102 GPU Architecture whitepaper v2.0, Appendix A, GeForce RTX 3090 "
                "(https://images.nvidia.com/aem-dam/en-zz/Solutions/geforce/ampere/pdf/"
                "NVIDIA-ampere-GA102-GPU-Architecture-Whitepaper-V1.pdf): peak FP32 35.6 TFLOPS; FP16 and "
                "BF16 Tensor with FP32 accumulate 71 TFLOPS dense (142 with FP16 accumulate, which "
                "PyTorch does not use; = 82 SMs x 1.695 GHz x 512 FLOP/clk/SM); 24 GB GDDR6X, "
                "384-bit at 19.5 Gbps = 936 GB/s"
            ),
        ),
        DeviceSpec(
            name="rtx_3090_ti",
            description="NVIDIA GeForce RTX 3090 Ti 24GB (GA102, 84 SMs, 1.86 GHz boost)",
            peak_flops_per_s={"fp32": 40.0 * _T, "fp16": 80.0 * _T, "bf16": 80.0 * _T},
            fp16_accumulate_flops_per_s=160.0 * _T,
            memory_bandwidth_bytes_per_s=1008 * _GB,
            memory_capacity_bytes=24 * _GIB,
            source=(
                "NVIDIA GeForce RTX 3090 family specifications "
                "(https://www.nvidia.com/en-us/geforce/graphics-cards/30-series/rtx-3090-3090ti/): "
                "10752 CUDA cores (84 SMs), 1.86 GHz boost, 24 GB GDDR6X, 384-bit at 21 Gbps = 1,008 GB/s; "
                "FP32 = 10752 x 2 x 1.86 GHz = 40.0 TFLOPS. Tensor rate from the NVIDIA Ampere GA102 "
                "whitepaper per-SM figure for GeForce GA10x with FP32 accumulate, 512 dense FP16 FLOP/clk/SM "
                "(84 SMs x 1.86 GHz x 512 = 80.0 TFLOPS; twice that with FP16 accumulate)"
            ),
        ),
        DeviceSpec(
            name="rtx_3080",
            description="NVIDIA GeForce RTX 3080 10GB (GA102, 68 SMs, 1.71 GHz boost)",
            peak_flops_per_s={"fp32": 29.8 * _T, "fp16": 59.5 * _T, "bf16": 59.5 * _T},
            fp16_accumulate_flops_per_s=119 * _T,
            memory_bandwidth_bytes_per_s=760 * _GB,
            memory_capacity_bytes=10 * _GIB,
            source=(
                "NVIDIA Ampere GA102 GPU Architecture whitepaper v2.0, Appendix A, GeForce RTX 3080 "
                "(https://images.nvidia.com/aem-dam/en-zz/Solutions/geforce/ampere/pdf/"
                "NVIDIA-ampere-GA102-GPU-Architecture-Whitepaper-V1.pdf): 8704 CUDA cores (68 SMs), "
                "1.71 GHz boost; peak FP32 29.8 TFLOPS; FP16 and BF16 Tensor with FP32 accumulate "
                "59.5 TFLOPS dense (119 with FP16 accumulate); 10 GB GDDR6X, 320-bit at 19 Gbps = 760 GB/s"
            ),
        ),
        DeviceSpec(
            name="rtx_3060_12gb",
            description="NVIDIA GeForce RTX 3060 12GB (GA106, 28 SMs, 1.777 GHz boost)",
            peak_flops_per_s={"fp32": 12.74 * _T, "fp16": 25.5 * _T, "bf16": 25.5 * _T},
            fp16_accumulate_flops_per_s=51.0 * _T,
            memory_bandwidth_bytes_per_s=360 * _GB,
            memory_capacity_bytes=12 * _GIB,
            source=(
                "NVIDIA RTX 3060 family specifications "
                "(https://www.nvidia.com/en-us/geforce/graphics-cards/30-series/rtx-3060-3060ti/): "
                "3584 CUDA cores, 1.777 GHz boost, 12 GB GDDR6, 192-bit at 15 Gbps = 360 GB/s; "
                "FP32 = 3584 x 2 x 1.777 GHz = 12.74 TFLOPS. Tensor rate derived from the NVIDIA "
                "Ampere GA102 whitepaper per-SM figures for GeForce GA10x: 1024 dense FP16 FLOP/clk/SM "
                "with FP16 accumulate (28 SMs x 1.777 GHz = 51 TFLOPS), half that with FP32 "
                "accumulate, which PyTorch uses: 25.5 TFLOPS"
            ),
        ),
        DeviceSpec(
            name="t4",
            description="NVIDIA T4 16GB",
            peak_flops_per_s={"fp32": 8.1 * _T, "fp16": 65 * _T},
            memory_bandwidth_bytes_per_s=320 * _GB,
            memory_capacity_bytes=16 * _GIB,
            source=(
                "NVIDIA T4 Tensor Core GPU datasheet "
                "(https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/"
                "t4-tensor-core-datasheet-951643.pdf): single precision 8.1 TFLOPS; mixed precision "
                "(FP16/FP32) 65 TFLOPS; 16 GB GDDR6 at 320 GB/s; Turing has no BF16"
            ),
        ),
        DeviceSpec(
            name="jetson_agx_orin",
            description="NVIDIA Jetson AGX Orin 64GB (2048-core Ampere GPU, 64 tensor cores, 1.3 GHz)",
            peak_flops_per_s={"fp32": 5.3 * _T, "fp16": 42.5 * _T, "bf16": 42.5 * _T},
            memory_bandwidth_bytes_per_s=204.8 * _GB,
            memory_capacity_bytes=64 * _GIB,
            source=(
                "NVIDIA Jetson AGX Orin Series technical brief and module datasheet "
                "(https://www.nvidia.com/content/dam/en-zz/Solutions/gtcf21/jetson-orin/"
                "nvidia-jetson-agx-orin-technical-brief.pdf): GPU 2048 CUDA cores, 64 tensor cores, "
                "1.3 GHz; FP32 = 2048 x 2 x 1.3 GHz = 5.3 TFLOPS; 64 GB LPDDR5 256-bit at "
                "204.8 GB/s, shared with the CPU; GPU 170 sparse INT8 TOPS = 85 dense, and FP16 at half "
                "the INT8 rate: 42.5 TFLOPS dense (16 SMs x 1.3 GHz x 2048 FLOP/clk, the data-centre "
                "Ampere rate, assumed also with FP32 accumulate)"
            ),
        ),
        DeviceSpec(
            name="jetson_agx_orin_32gb",
            description="NVIDIA Jetson AGX Orin 32GB (1792-core Ampere GPU, 56 tensor cores, 930 MHz)",
            peak_flops_per_s={"fp32": 3.33 * _T, "fp16": 26.7 * _T, "bf16": 26.7 * _T},
            memory_bandwidth_bytes_per_s=204.8 * _GB,
            memory_capacity_bytes=32 * _GIB,
            source=(
                "NVIDIA Jetson AGX Orin Series module datasheet: GPU 1792 CUDA cores, 56 tensor "
                "cores, 930 MHz; FP32 = 1792 x 2 x 0.93 GHz = 3.33 TFLOPS; FP16 tensor scaled from "
                "the 64GB module by cores x clock; 32 GB LPDDR5 256-bit at 204.8 GB/s"
            ),
        ),
        DeviceSpec(
            name="cpu",
            description="Generic server CPU: 16 cores, AVX2 + FMA, DDR4/DDR5 (an assumption, not a product)",
            peak_flops_per_s={"fp32": 1.0 * _T, "bf16": 1.0 * _T},
            memory_bandwidth_bytes_per_s=50 * _GB,
            memory_capacity_bytes=64 * _GIB,
            source=(
                "Assumed, not a datasheet: 16 cores x 2 FMA units x 8 FP32 lanes x 2 FLOP x ~2-3 GHz "
                "is 1-1.5 TFLOP/s peak, taken as 1 TFLOP/s since GEMMs rarely reach AVX peak; "
                "bf16 at the fp32 rate (converted to fp32 without AMX / AVX512-BF16); fp16 "
                "omitted (slow fallback kernels on most CPUs); about 2-4 DDR channels = 50 GB/s; 64 GB. "
                "One core alone (a single-threaded rank): 2 FMA units x 8 FP32 lanes x 2 FLOP x 2.5 GHz (the "
                "middle of the range above) = 80 GFLOP/s peak, the whole CPU's figure having been rounded down "
                "for GEMM efficiency, which the roofline's flops_efficiency says for one core; and 10 GB/s of "
                "memory bandwidth, which its outstanding "
                "cache-line misses bound (Little's law, Little 1961: bandwidth = misses in flight x 64 B / "
                "DRAM latency; 10-12 line fill buffers over 65-80 ns = 8-12 GB/s; Intel 64 and IA-32 "
                "Architectures Optimization Reference Manual, the L1 data cache's fill buffers)"
            ),
            core_peak_flops_per_s={"fp32": 80 * _GB, "bf16": 80 * _GB},
            core_memory_bandwidth_bytes_per_s=10 * _GB,
        ),
    )
}
"""Catalog of known devices, keyed by the name a cluster description uses."""


def get_device(name: str, field: str = "type") -> DeviceSpec:
    """Look up a device in :data:`DEVICES`.

    Raises:
        ConfigError: (on ``field``) ``unknown device; known: ... (got 'x')`` listing every catalog name.
    """
    try:
        return DEVICES[name]
    except KeyError:
        raise ConfigError(field, f"unknown device; known: {', '.join(DEVICES)} (got {name!r})") from None
