"""What this machine is (CPU model and instruction sets, cores, GPUs) and the one precision rule.

Torch-free, so `plan` can ask it without loading torch; model/device.py feeds the rule torch's own
answers (a CUDA device's bf16, oneDNN's bf16 support) where torch is loaded anyway.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from torchloom.errors import UserError

PRECISIONS = ("auto", "fp32", "bf16", "fp16")


@dataclass(frozen=True)
class CPU:
    """One machine's CPU as the kernels see it."""

    model: str
    arch: str  # platform.machine(): x86_64, aarch64, arm64
    cores: int  # the cores this process may run on
    flags: frozenset[str]
    mhz: float = 0.0  # the clock /proc/cpuinfo reports (0: unknown)
    vendor: str = ""  # GenuineIntel, AuthenticAMD, ...
    family: int = 0  # x86 cpu family and model numbers (0: unknown)
    model_id: int = 0

    @property
    def bf16_how(self) -> str | None:
        """The hardware that runs bf16 matmuls natively, or None where torch would emulate them."""
        if "amx_bf16" in self.flags:
            return "AMX"
        if "avx512_bf16" in self.flags:
            return "AVX512-BF16"
        if self.arch in ("aarch64", "arm64") and "bf16" in self.flags:
            return "Arm BF16"
        return None

    @property
    def int8_how(self) -> str | None:
        """The hardware that runs int8 dot products (quantized inference), or None."""
        for flag, name in (("amx_int8", "AMX-INT8"), ("avx512_vnni", "AVX512-VNNI"), ("avx_vnni", "AVX-VNNI"),
                           ("i8mm", "Arm I8MM"), ("asimddp", "Arm dot product")):
            if flag in self.flags:
                return name
        return None

    @property
    def vector(self) -> str:
        """The widest vector instruction set: what the fp32 peak scales with."""
        if "avx512f" in self.flags:
            return "AVX-512"
        if "avx2" in self.flags:
            return "AVX2"
        if "avx" in self.flags:
            return "AVX"
        if self.arch in ("aarch64", "arm64"):
            return "SVE" if "sve" in self.flags else "NEON"
        return "SSE"

    def fp32_flops_per_cycle(self) -> int:
        """Per core: 2 FMA units x lanes x 2 (multiply and add). AMD's Zen 1 (family 23, models below 0x30)
        runs each 256-bit FMA as two 128-bit halves: half of that. The demo trained at 6.1 samples/s (fp32,
        2 x 1 thread) on such a guest, MFU 0.82 of the halved peak, as other CPUs reach of their full one."""
        lanes = {"AVX-512": 16, "AVX2": 8, "AVX": 8, "SVE": 4, "NEON": 4}.get(self.vector, 4)
        zen1 = self.vendor == "AuthenticAMD" and self.family == 23 and self.model_id < 0x30
        return 2 * (1 if zen1 else 2) * lanes

    def describe(self) -> str:
        bf16 = f"native bf16 ({self.bf16_how})" if self.bf16_how else "no native bf16"
        int8 = f"int8 dot products ({self.int8_how})" if self.int8_how else "no int8 dot-product instructions"
        return f"{self.model}, {self.cores} core{'s' if self.cores != 1 else ''}, {self.vector}, {bf16}, {int8}"


def _cpuinfo() -> dict[str, str]:
    """The first processor's block of /proc/cpuinfo (Linux), else {}."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    info: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            info.setdefault(key.strip().lower(), value.strip())
    return info


def usable_cores() -> int:
    """The cores this process may use: its CPU affinity where the OS tells it, else the machine's count.
    The one rule for threads, Spark's local[*] and a local Ray instance's CPUs."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.lru_cache(maxsize=1)
def cpu() -> CPU:
    info = _cpuinfo()
    model = info.get("model name") or info.get("cpu model") or platform.processor() or platform.machine() or "CPU"
    flags = frozenset((info.get("flags") or info.get("features") or "").split())
    return CPU(model=" ".join(model.split()), arch=platform.machine().lower(), cores=usable_cores(), flags=flags,
               mhz=_number(info.get("cpu mhz")), vendor=info.get("vendor_id", ""),
               family=int(_number(info.get("cpu family"))), model_id=int(_number(info.get("model"))))


def _number(text: str | None) -> float:
    try:
        return float(text or 0)
    except ValueError:
        return 0.0


def memory_gib() -> float:
    """This machine's memory (MemTotal of /proc/meminfo), 0 where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def gpu_names() -> list[str]:
    """The visible NVIDIA GPUs' names from nvidia-smi (no torch), honouring CUDA_VISIBLE_DEVICES; [] without."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return []
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=index,name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = [line.split(",", 1) for line in out.splitlines() if "," in line]
    if visible:
        keep = [v.strip() for v in visible.split(",")]
        gpus = [g for g in gpus if g[0].strip() in keep]
    return [name.strip() for _, name in gpus]


# Dense peak TFLOP/s (no sparsity) from NVIDIA's data sheets: (tensor cores at bf16/fp16, fp32 without TF32, which
# is PyTorch's default for matmuls). The first pattern that matches a GPU's name (upper case) wins; a GPU that none
# matches has no peak, and no MFU is reported for it. A10G (AWS) is absent: NVIDIA publishes no figures for it.
GPU_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200 NVL", 835.5, 60.0), ("GH200", 989.4, 67.0), ("H200", 989.4, 67.0),
    ("H100 NVL", 835.5, 60.0), ("H100 PCIE", 756.5, 51.2), ("H100", 989.4, 67.0),
    ("A100", 312.0, 19.5), ("L40S", 362.1, 91.6), ("L4", 121.0, 30.3), ("A10G", 0.0, 0.0), ("A10", 125.0, 31.2),
    ("V100-PCIE", 112.0, 14.0), ("V100", 125.0, 15.7),  # no bf16 on V100: its fp16 figure
    ("T4", 65.0, 8.1),  # fp16; no bf16
)


def gpu_peak_tflops(name: str, precision: str) -> float | None:
    """The dense peak of the GPU named `name` (nvidia-smi's or torch's name) for `precision` (bf16 and fp16 use the
    tensor cores, fp32 the plain units), or None where it is not known."""
    upper = name.upper()
    for pattern, half, fp32 in GPU_PEAKS:
        if re.search(rf"(?<![A-Z0-9]){re.escape(pattern)}(?![A-Z0-9])", upper):
            return (fp32 if precision == "fp32" else half) or None
    return None


# -- the precision rule ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class PrecisionChoice:
    precision: str  # fp32 | bf16 | fp16
    reason: str  # why, for the run's summary: "auto: this CPU has no native bf16"
    warning: str | None = None  # one line when an explicit choice will run slowly here


def choose_precision(setting: str, device: str, *, cpu_bf16: str | None, cuda_bf16: bool = False,
                     key: str = "train.precision", scaler_ok: bool = True) -> PrecisionChoice:
    """The one rule every stage asks (train, evaluate, serve, predict, Spark batch, plan, calibrate).

    setting: auto | fp32 | bf16 | fp16; device: "cpu" or "cuda" (or cuda:N); cpu_bf16: how this CPU runs bf16
    natively (CPU.bf16_how), None where torch emulates it; cuda_bf16: the GPU has bf16 (Ampere and later).
    auto: bf16 on a GPU that has it, else fp16 with a gradient scaler; on CPU bf16 only where it is native,
    else fp32. fp16 on CPU is refused everywhere (no CPU autocast runs it fast, and no scaler is used there).
    scaler_ok: fp16 training may use a gradient scaler (strategy ddp); where it may not, auto on a GPU
    without bf16 is fp32.
    """
    if setting not in PRECISIONS:
        raise UserError(f"{key} {setting}: unknown; use one of {', '.join(PRECISIONS)}")
    on_cuda = device.startswith("cuda")
    if setting == "auto":
        if on_cuda:
            if cuda_bf16:
                return PrecisionChoice("bf16", "auto: this GPU runs bf16")
            if scaler_ok:
                return PrecisionChoice("fp16", "auto: this GPU has no bf16, so fp16 with a gradient scaler")
            return PrecisionChoice("fp32", "auto: this GPU has no bf16, and fp16's gradient scaler runs with"
                                           " train.strategy ddp only")
        if cpu_bf16:
            return PrecisionChoice("bf16", f"auto: this CPU runs bf16 natively ({cpu_bf16})")
        return PrecisionChoice("fp32", "auto: this CPU has no native bf16")
    if setting == "fp16" and not on_cuda:
        raise UserError(f"{key} fp16: float16 autocast needs a CUDA GPU; on CPU use auto, fp32 or bf16")
    warning = None
    if setting == "bf16" and on_cuda and not cuda_bf16:
        warning = (f"{key} bf16: this GPU has no native bf16 and emulates it slowly; {key} auto picks fp16"
                   " with a gradient scaler")
    elif setting == "bf16" and not on_cuda and not cpu_bf16:
        warning = (f"{key} bf16: this CPU has no native bf16 (no AMX or AVX512-BF16), so torch emulates it,"
                   f" {bf16_slowdown()}; {key} auto picks fp32")
    return PrecisionChoice(setting, "as configured", warning)


# -- what `plan --calibrate` measured here, for the warning above ---------------------------------------

def calibration_file() -> Path:
    base = os.environ.get("TORCHLOOM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "torchloom")
    return Path(base) / "calibration.json"


def cpu_key(c: CPU | None = None) -> str:
    c = c or cpu()
    return f"{c.model} | {c.vector} | {c.bf16_how or 'no bf16'} | {c.cores} cores"


def save_calibration(step_seconds: dict[str, float]) -> None:
    """Record the seconds per training step per precision that `plan --calibrate` measured on this CPU."""
    path = calibration_file()
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        data = {}
    data[cpu_key()] = {k: round(v, 4) for k, v in step_seconds.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass  # a cache: nothing depends on it


def bf16_slowdown() -> str:
    """'x times slower than fp32' as `plan --calibrate` measured it on this CPU, else how to measure it."""
    try:
        seen = json.loads(calibration_file().read_text(encoding="utf-8")).get(cpu_key(), {})
    except (OSError, ValueError):
        seen = {}
    if seen.get("fp32") and seen.get("bf16"):
        return f"{seen['bf16'] / seen['fp32']:.1f}x slower than fp32 as `torchloom plan --calibrate` measured here"
    return "typically ~10x slower than fp32 (`torchloom plan --calibrate` measures it here)"
