"""Device kinds (memory, FLOP/s, bandwidths) and how many of them on how many nodes."""

from __future__ import annotations

from dataclasses import dataclass, replace

from torchloom import machine
from torchloom.errors import UserError

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class DeviceSpec:
    """One device kind. Bandwidths are per direction, as collectives reach them (not link maxima)."""

    name: str
    memory_gib: float
    tflops_bf16: float  # dense peak, also used for fp16
    tflops_fp32: float  # dense peak without TF32 (PyTorch's default for matmuls)
    mem_bw_gbs: float  # memory bandwidth: the optimizer update is bound by it
    intra_bw_gbs: float  # per device, to the other devices of its node
    inter_bw_gbs: float  # per node, all its network cards together
    latency_intra_us: float
    latency_inter_us: float
    mfu: float  # model FLOPs utilisation reached in forward + backward
    devices_per_node: int  # the default when only --devices is given
    shared_host: bool = False  # several devices on one node split its memory, FLOP/s and memory bandwidth
    fused_optimizer: bool = True  # one pass over the states (CUDA fused AdamW) or several (CPU foreach)
    overlap: bool = True  # can communication run while computing (separate copy engines / SMs)?
    description: str = ""  # what was detected (this machine's CPU or GPU), for the report

    def peak_flops(self, precision: str) -> float:
        return (self.tflops_fp32 if precision == "fp32" else self.tflops_bf16) * 1e12


# bf16 step time against fp32 on a CPU, by how it runs bf16 (a step, not a matmul: autocast's casts and the
# fp32 optimizer stay). Native: measured with `plan --calibrate` (AMX 1.40x, AVX512-BF16 1.26x faster);
# emulated (AVX2 or AVX-512 without BF16): ~11x slower, measured on an AMD EPYC with AVX2 (docs/benchmarks.md).
BF16_STEP_SPEEDUP = {"AMX": 1.40, "AVX512-BF16": 1.26, "Arm BF16": 1.26, None: 1 / 11}


def cpu() -> DeviceSpec:
    """This machine's CPU (torchloom.machine): its peaks from its cores, clock and vector units.

    fp32 peak = cores x GHz x FLOPs per cycle (2 FMA units x lanes x 2; Zen 1 half of that); the bf16 figure
    is that times the measured step speed-up of bf16 on this kind of CPU (BF16_STEP_SPEEDUP), so a CPU
    that emulates bf16 plans it slower, as it runs. MFU 0.8: forward + backward reached 0.77 (fp32) and
    0.87 (bf16) of such peaks with training's fused kernels (attention dropout 0, fused AdamW); `plan
    --calibrate` checks it against real steps here. The optimizer is costed apart, by memory bandwidth
    (12 GB/s: a 256 MiB copy measured 10-16 GB/s). Network: gloo over loopback TCP between workers on one
    machine (~2 GB/s); 10 GbE between nodes.
    """
    c = machine.cpu()
    ghz = (c.mhz or 2000.0) / 1000
    fp32 = c.cores * ghz * c.fp32_flops_per_cycle() / 1000  # TFLOP/s
    bf16 = fp32 * BF16_STEP_SPEEDUP.get(c.bf16_how, 1.26)
    return DeviceSpec("cpu", memory_gib=round(machine.memory_gib(), 1) or 16.0, tflops_bf16=round(bf16, 4),
                      tflops_fp32=round(fp32, 4), mem_bw_gbs=12, intra_bw_gbs=2.0, inter_bw_gbs=1.0,
                      latency_intra_us=20, latency_inter_us=50, mfu=0.8, devices_per_node=1, shared_host=True,
                      fused_optimizer=True, overlap=False, description=c.describe())


def _peak(gpu: str, precision: str) -> float:
    """A preset's dense peak: the one table training's MFU reads too (machine.GPU_PEAKS)."""
    peak = machine.gpu_peak_tflops(gpu, precision)
    assert peak is not None, gpu
    return peak


def a100_40g() -> DeviceSpec:
    # DGX-class node: 8 GPUs on NVLink 3 (300 GB/s per direction, NCCL reaches ~240),
    # one 200 Gb/s InfiniBand card per GPU: 8 x 25 GB/s, ~80% of it reached -> 160 GB/s per node.
    return DeviceSpec("a100-40g", memory_gib=40, tflops_bf16=_peak("A100", "bf16"), tflops_fp32=_peak("A100", "fp32"),
                      mem_bw_gbs=1555,
                      intra_bw_gbs=240, inter_bw_gbs=160, latency_intra_us=2, latency_inter_us=5, mfu=0.4,
                      devices_per_node=8)


def a100_80g() -> DeviceSpec:
    return replace(a100_40g(), name="a100-80g", memory_gib=80, mem_bw_gbs=2039)


def h100() -> DeviceSpec:
    # SXM: NVLink 4 (450 GB/s per direction, NCCL reaches ~360), one 400 Gb/s card per GPU (~320 GB/s per node).
    return replace(a100_80g(), name="h100", tflops_bf16=_peak("H100", "bf16"), tflops_fp32=_peak("H100", "fp32"),
                   mem_bw_gbs=3350, intra_bw_gbs=360, inter_bw_gbs=320)


def h200() -> DeviceSpec:
    return replace(h100(), name="h200", memory_gib=140, mem_bw_gbs=4800)


DEVICES = {"cpu": cpu, "a100-40g": a100_40g, "a100-80g": a100_80g, "h100": h100, "h200": h200}


def detect() -> str:
    """The preset for this machine: its GPU's (nvidia-smi, no torch) where one is visible, else cpu."""
    names = machine.gpu_names()
    if not names:
        return "cpu"
    name = names[0].upper()
    for key, preset in (("H200", "h200"), ("H100", "h100"), ("GH200", "h100")):
        if key in name:
            return preset
    if "A100" in name:
        return "a100-80g" if "80G" in name else "a100-40g"
    raise UserError(f"--device-type auto: this machine's GPU ({names[0]}) has no preset; pass --device-type with"
                    f" the closest of {', '.join(DEVICES)} and --tflops / --memory-gib / --mem-bw for its numbers")


def device(name: str, **overrides) -> DeviceSpec:
    """A preset with the given fields replaced (None leaves a field as the preset has it); auto: detect()."""
    if name == "auto":
        name = detect()
        if name != "cpu":
            overrides.setdefault("description", f"{machine.gpu_names()[0]} (detected)")
    if name not in DEVICES:
        raise UserError(f"--device-type {name}: unknown; use auto or one of {', '.join(DEVICES)}"
                        " (and --memory-gib, --tflops, ... for your own numbers)")
    spec = DEVICES[name]()
    return replace(spec, **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class Cluster:
    device: DeviceSpec
    nodes: int
    devices_per_node: int

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    # -- what one device gets when a node's resources are shared (CPU workers) ---------------------
    def _share(self) -> int:
        return self.devices_per_node if self.device.shared_host else 1

    def memory_bytes(self) -> float:
        return self.device.memory_gib * GIB / self._share()

    def flops(self, precision: str) -> float:
        return self.device.peak_flops(precision) / self._share()

    def mem_bw(self) -> float:
        return self.device.mem_bw_gbs * GB / self._share()

    def collective_bw(self, spans_nodes: bool) -> float:
        """Bytes/s a ring collective moves per device: a ring that leaves the node is bound by the node's
        network cards (all devices' rings share them), one inside it by the device's own links."""
        intra = self.device.intra_bw_gbs * GB
        return min(intra, self.device.inter_bw_gbs * GB) if spans_nodes else intra

    def p2p_bw(self, crosses_nodes: bool) -> float:
        """Bytes/s for one device's point-to-point send; across nodes it gets its share of the cards."""
        intra = self.device.intra_bw_gbs * GB
        return min(intra, self.device.inter_bw_gbs * GB / self.devices_per_node) if crosses_nodes else intra

    def latency(self, spans_nodes: bool) -> float:
        return (self.device.latency_inter_us if spans_nodes else self.device.latency_intra_us) * 1e-6


def cluster(spec: DeviceSpec, devices: int | None, nodes: int | None, devices_per_node: int | None) -> Cluster:
    """Fill in the one of devices / nodes / devices-per-node that was not given."""
    for flag, value in (("--devices", devices), ("--nodes", nodes), ("--devices-per-node", devices_per_node)):
        if value is not None and value < 1:
            raise UserError(f"{flag} {value}: must be at least 1")
    if devices is not None and nodes is not None and devices_per_node is not None:
        if devices != nodes * devices_per_node:
            raise UserError(f"--devices {devices} is not --nodes {nodes} x --devices-per-node {devices_per_node};"
                            " give two of the three")
    elif devices is not None and nodes is not None:
        if devices % nodes:
            raise UserError(f"--devices {devices} does not divide over --nodes {nodes}; use a multiple of {nodes}")
        devices_per_node = devices // nodes
    elif devices is not None:
        per_node = devices_per_node or min(devices, spec.devices_per_node)
        if devices % per_node:
            raise UserError(f"--devices {devices} does not fill nodes of {per_node}; give --nodes or"
                            " --devices-per-node too")
        devices_per_node, nodes = per_node, devices // per_node
    elif nodes is not None:
        devices_per_node = devices_per_node or spec.devices_per_node  # whole nodes: 8 GPUs, 1 CPU machine
    else:
        nodes, devices_per_node = 1, devices_per_node or 1  # nothing said: one device
    return Cluster(spec, nodes=nodes, devices_per_node=devices_per_node)

