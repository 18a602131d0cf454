"""Defaults from the hardware: the one precision rule, workers counted on the machine, the planner's
view of the CPU. The capability probes are replaced by each machine kind's answers."""

from __future__ import annotations

import json

import pytest

from torchloom import machine
from torchloom.config import build, resolve_workers
from torchloom.errors import UserError
from torchloom.model import device


def cpu_with(*flags: str, arch: str = "x86_64") -> machine.CPU:
    return machine.CPU(model="Test CPU", arch=arch, cores=2, flags=frozenset(flags), mhz=2000.0)


def test_the_cpu_flags_say_how_bf16_and_int8_run():
    assert cpu_with("avx2", "fma").bf16_how is None and cpu_with("avx2").vector == "AVX2"
    assert cpu_with("avx512f", "avx512_bf16", "avx512_vnni").bf16_how == "AVX512-BF16"
    assert cpu_with("avx512f", "amx_bf16", "amx_int8").bf16_how == "AMX"
    assert cpu_with("avx512f", "amx_bf16", "amx_int8").int8_how == "AMX-INT8"
    assert cpu_with("avx512f").bf16_how is None  # AVX-512 alone emulates bf16
    assert cpu_with("asimd", "bf16", arch="aarch64").bf16_how == "Arm BF16"
    assert cpu_with("avx2").int8_how is None and "no native bf16" in cpu_with("avx2").describe()


# (name, device, CPU's native bf16, GPU's bf16) -> what auto picks, and why
MACHINES = {
    "no native bf16": ("cpu", None, False, "fp32", "auto: this CPU has no native bf16"),
    "AMX": ("cpu", "AMX", False, "bf16", "auto: this CPU runs bf16 natively (AMX)"),
    "CUDA without bf16": ("cuda", None, False, "fp16", "auto: this GPU has no bf16, so fp16 with a gradient scaler"),
    "CUDA with bf16": ("cuda", None, True, "bf16", "auto: this GPU runs bf16"),
}


@pytest.fixture
def probed(monkeypatch):
    """Make model/device.py's probes answer as the named machine does."""
    def as_machine(name: str) -> str:
        where, cpu_bf16, cuda_bf16, _, _ = MACHINES[name]
        monkeypatch.delenv(device.CPU_BF16_ENV, raising=False)
        monkeypatch.setattr(device, "cpu_bf16", lambda: cpu_bf16)
        monkeypatch.setattr(device, "cuda_bf16", lambda: cuda_bf16)
        return where
    return as_machine


@pytest.mark.parametrize("name", list(MACHINES))
def test_auto_picks_the_fast_path_of_each_machine_and_warns_only_of_emulated_bf16(probed, name):
    where = probed(name)
    _, cpu_bf16, cuda_bf16, expected, reason = MACHINES[name]
    auto = device.choose_precision("auto", where)
    assert (auto.precision, auto.reason, auto.warning) == (expected, reason, None)
    for key in ("train.precision", "eval.precision", "--precision"):  # every stage asks the same rule
        assert device.choose_precision("auto", where, key=key).precision == expected
    asked = device.choose_precision("bf16", where)
    assert asked.precision == "bf16"
    native = cpu_bf16 if where == "cpu" else cuda_bf16
    if native:
        assert asked.warning is None
    else:
        assert asked.warning and "bf16" in asked.warning and "auto picks" in asked.warning
        assert "\n" not in asked.warning
    assert device.choose_precision("fp32", where).warning is None


def test_fp16_is_refused_on_cpu_everywhere_and_auto_avoids_the_scaler_where_it_cannot_run(probed):
    probed("no native bf16")
    for key in ("train.precision", "eval.precision", "--precision"):
        with pytest.raises(UserError, match=f"{key} fp16: float16 autocast needs a CUDA GPU"):
            device.choose_precision("fp16", "cpu", key=key)
    probed("CUDA without bf16")
    assert device.choose_precision("auto", "cuda", scaler_ok=False).precision == "fp32"  # FSDP, pipeline
    assert device.choose_precision("fp16", "cuda:1").precision == "fp16"


def test_the_emulated_bf16_warning_quotes_what_calibrate_measured(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHLOOM_CACHE", str(tmp_path))
    assert "plan --calibrate` measures it" in machine.bf16_slowdown()
    machine.save_calibration({"fp32": 0.40, "bf16": 4.6})
    assert machine.bf16_slowdown().startswith("11.5x slower than fp32")
    warning = machine.choose_precision("bf16", "cpu", cpu_bf16=None).warning
    assert "11.5x slower" in warning


def test_the_env_override_of_the_cpu_probe(monkeypatch):
    monkeypatch.setenv(device.CPU_BF16_ENV, "0")
    assert device.cpu_bf16() is None and device.choose_precision("auto", "cpu").precision == "fp32"
    monkeypatch.setenv(device.CPU_BF16_ENV, "AMX")
    assert device.choose_precision("auto", "cpu").reason == "auto: this CPU runs bf16 natively (AMX)"


def test_workers_auto_is_one_per_gpu_and_the_cpu_default_elsewhere(tmp_path):
    def cfg(*extra: str):
        return build(None, ["--output.dir", str(tmp_path), *extra])

    assert cfg().engine.workers == "auto"  # counted only once the machine is known
    assert resolve_workers(cfg(), gpus=0).engine.workers == 2
    assert resolve_workers(cfg(), gpus=1).engine.workers == 1
    assert resolve_workers(cfg(), gpus=8).engine.workers == 8
    assert resolve_workers(cfg(), gpus=3).engine.workers == 2  # the largest that divides the batch of 16
    assert resolve_workers(cfg("--engine.device", "cpu"), gpus=4).engine.workers == 2
    # Ray on an instance torchloom starts here sees this machine's GPUs; a cluster's are counted at its launch
    assert resolve_workers(cfg("--engine.name", "ray"), gpus=4).engine.workers == 4
    assert resolve_workers(cfg("--engine.name", "ray", "--engine.ray_address", "auto"), gpus=4).engine.workers == 2
    assert resolve_workers(cfg("--engine.name", "spark"), gpus=4).engine.workers == 2
    assert resolve_workers(cfg("--engine.workers", "4"), gpus=0).engine.workers == 4
    with pytest.raises(UserError, match="engine.workers 2: this machine has 1 visible GPU and each worker"):
        resolve_workers(cfg("--engine.workers", "2"), gpus=1)
    with pytest.raises(UserError, match="engine.device cuda: torch sees no CUDA device"):
        resolve_workers(cfg("--engine.device", "cuda"), gpus=0)
    with pytest.raises(UserError, match="train.batch_size 16: must be a multiple"):  # checked once counted
        resolve_workers(cfg("--engine.workers", "3", "--train.batch_size", "16"), gpus=0)
    assert resolve_workers(cfg("--engine.workers", "3"), gpus=0).engine.workers == 3  # batch auto: rounded up


def test_batch_size_auto_grows_only_where_the_data_has_steps_to_spare(tmp_path, capsys):
    from torchloom.config import budget, save
    from torchloom.data.synthetic import write_synthetic_dataset
    from torchloom.runs.rundir import RunDir
    from torchloom.stages.train import how_long

    assert budget.choose_batch(5, 1780, 128)[0] == 16  # the demo: 2 epochs of 112 steps are 225 needed
    assert budget.choose_batch(2, 3610, 128)[0] == 16  # SMS: 32 would give 2 epochs of 113 steps < 4 x 90 needed
    assert budget.choose_batch(2, 12000, 128)[0] == 64  # 2 epochs of 188 steps >= 4 x 90; 128 would give 94
    assert budget.choose_batch(4, 1_000_000, 128)[0] == 256  # at most 32,768 tokens a step
    assert budget.choose_batch(4, 1_000_000, 512)[0] == 64
    assert budget.choose_batch(52, 7000, 128)[0] == 16  # many classes: never below 16
    assert budget.choose_batch(2, 12000, 128, multiple=3)[0] == 66  # rounded up to workers x grad_accum
    assert [budget.choose_batch(4, 1_000_000, 128, multiple=w)[0] for w in (1, 2, 4, 8, 16)] == [256] * 5
    # epochs auto counts the steps of the batch chosen: large data gets the minimum, 2
    cfg, line = budget.resolve(build(None, []), 4, 1_000_000)
    assert (cfg.train.batch_size, cfg.train.epochs) == (256, 2) and line.startswith("batch_size auto: 256 (")
    cfg, line = budget.resolve(build(None, []), 5, 1780)
    assert cfg.train.batch_size == 16 and "batch_size" not in line  # nothing new to say
    # the driver: from the prepared data; a resumed run keeps the batch its config.toml recorded
    rd = tmp_path / "run"
    write_synthetic_dataset(rd / "data", rows={"train": 12000, "val": 8, "test": 8}, num_labels=2)
    fresh = how_long(build(None, ["--output.dir", str(rd), "--engine.workers", "2"]), RunDir(rd))
    assert fresh.train.batch_size == 64 and "batch_size auto: 64" in capsys.readouterr().err
    save(build(None, ["--output.dir", str(rd), "--train.batch_size", "32"]), rd / "config.toml")
    resumed = how_long(build(None, ["--output.dir", str(rd), "--engine.workers", "2"]), RunDir(rd), resuming=True)
    assert resumed.train.batch_size == 32


def test_a_ray_cluster_with_fewer_gpus_than_workers_says_they_train_on_cpus(monkeypatch, tmp_path, capsys):
    ray = pytest.importorskip("ray")
    from torchloom.engines.ray import scaling

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 1.0})
    cfg = build(None, ["--output.dir", str(tmp_path), "--engine.name", "ray", "--engine.workers", "2"])
    assert not scaling(cfg, started_local=False).use_gpu
    err = capsys.readouterr().err
    assert "the Ray cluster has 1 GPU(s) for 2 workers, so they train on CPUs; pass --engine.workers 1" in err
    cfg = build(None, ["--output.dir", str(tmp_path), "--engine.name", "ray", "--engine.workers", "1"])
    assert scaling(cfg, started_local=False).use_gpu and not capsys.readouterr().err


def test_more_workers_than_gpus_is_refused_before_prepare_runs(monkeypatch, tmp_path, capsys):
    from torchloom import cli, preflight

    monkeypatch.setattr(preflight, "visible_gpus", lambda cfg: 1)
    out = tmp_path / "run"
    code = cli.main(["run", "--output.dir", str(out), "--engine.workers", "2", "--tracking.enabled", "false"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "engine.workers 2: this machine has 1 visible GPU" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()  # nothing prepared, nothing written


def test_plan_takes_the_cpu_from_the_machine_and_the_precision_from_the_rule(monkeypatch, capsys):
    from torchloom.plan import command, hardware

    monkeypatch.setattr(machine, "gpu_names", lambda: [])
    monkeypatch.setattr(machine, "cpu", lambda: cpu_with("avx2", "fma"))
    assert command.main(["--json"]) == 0
    avx2 = json.loads(capsys.readouterr().out)
    assert avx2["job"]["precision"] == "fp32"
    assert hardware.cpu().tflops_fp32 == pytest.approx(2 * 2.0 * 32 / 1000)
    assert hardware.cpu().tflops_bf16 < hardware.cpu().tflops_fp32  # emulated: planned slower, as it runs
    monkeypatch.setattr(machine, "cpu", lambda: cpu_with("avx512f", "amx_bf16", "amx_int8"))
    assert command.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["job"]["precision"] == "bf16"
    assert command.main([]) == 0
    assert "hardware Test CPU, 2 cores, AVX-512, native bf16 (AMX), int8 dot products (AMX-INT8)" in (
        capsys.readouterr().out)
    monkeypatch.setattr(machine, "gpu_names", lambda: ["NVIDIA H100 80GB HBM3"])
    assert hardware.detect() == "h100"
    monkeypatch.setattr(machine, "gpu_names", lambda: ["Tesla T4"])
    assert command.main([]) == 2 and "has no preset" in capsys.readouterr().err


def test_plan_reads_a_prepared_run(tmp_path, capsys):
    from torchloom.data.synthetic import write_synthetic_dataset
    from torchloom.plan import command

    write_synthetic_dataset(tmp_path / "run" / "data", rows={"train": 96, "val": 8, "test": 8})
    assert command.main(["--run", str(tmp_path / "run"), "--device-type", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    job = out["job"]
    # epochs: what train.epochs auto chooses for 3 classes of 96 rows (6 steps an epoch): the cap, 5
    assert job["rows"] == 96 and job["epochs"] == 5 and out["cluster"]["devices"] == 2 and job["micro_batch"] == 8
    assert command.main(["--run", str(tmp_path / "nothing")]) == 2
    assert "no prepared data there" in capsys.readouterr().err
    # a run that trained: the estimate beside what it measured, for the strategy it ran
    from torchloom.config import build, save

    save(build(None, ["--output.dir", str(tmp_path / "run")]), tmp_path / "run" / "config.toml")
    (tmp_path / "run" / "train_result.json").write_text(json.dumps({"samples_per_s": 20.0, "tokens_per_s": 900.0}))
    assert command.main(["--run", str(tmp_path / "run"), "--device-type", "cpu", "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)["measured"]
    assert measured["strategy"] == "ddp" and measured["samples_per_s"] == 20.0
    assert measured["ratio"] == pytest.approx(measured["estimated_samples_per_s"] / 20.0, rel=0.01)
    assert command.main(["--run", str(tmp_path / "run"), "--device-type", "cpu"]) == 0
    assert "measured: the run trained at 20.0 samples/s with ddp (train_result.json)" in capsys.readouterr().out


def test_mfu_reads_one_table_of_dense_peaks_and_never_guesses():
    assert machine.gpu_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert machine.gpu_peak_tflops("NVIDIA H100 PCIe", "fp16") == 756.5
    assert machine.gpu_peak_tflops("NVIDIA A100-SXM4-40GB", "fp32") == 19.5
    assert machine.gpu_peak_tflops("NVIDIA A10", "bf16") == 125.0  # not A100's, not A10G's
    assert machine.gpu_peak_tflops("NVIDIA A10G", "bf16") is None  # NVIDIA publishes none
    assert machine.gpu_peak_tflops("NVIDIA GeForce RTX 4090", "bf16") is None
    from torchloom.plan import hardware

    assert hardware.h100().tflops_bf16 == 989.4 and hardware.a100_40g().tflops_fp32 == 19.5  # plan's, the same


# -- GPU paths, their logic on a CPU (torch's device queries monkeypatched) -------------------------------------
def test_a_cuda_device_past_the_count_is_one_line(monkeypatch):
    monkeypatch.setattr(device.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device.torch.cuda, "device_count", lambda: 2)
    assert device.resolve_device("cuda:1") == "cuda:1" and device.resolve_device("auto") == "cuda"
    for wrong in ("cuda:2", "cuda:x"):
        with pytest.raises(UserError, match=rf"--device {wrong}: this machine shows torch 2 CUDA device\(s\),"
                                            r" cuda:0 to cuda:1"):
            device.resolve_device(wrong)


def test_a_resume_on_fewer_gpus_than_the_writer_restores_the_rng_of_those_it_has(monkeypatch):
    from torchloom.train import checkpoint

    state = checkpoint.rng_state()
    state["cuda"] = ["state of gpu 0", "state of gpu 1"]  # written by a process that saw two devices
    restored = []
    monkeypatch.setattr(checkpoint.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(checkpoint.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(checkpoint.torch.cuda, "set_rng_state", lambda s, index: restored.append((index, s)))
    checkpoint.set_rng_state(state)
    assert restored == [(0, "state of gpu 0")]


def test_ray_serve_replicas_and_spark_scoring_tasks_spread_over_the_gpus_they_are_given():
    """The logic of the two multi-GPU placements (a GPU runs them for real: tests/test_serve.py's CUDA tests)."""
    pytest.importorskip("pyspark")
    from pyspark.resource.information import ResourceInformation

    from torchloom.batch.spark import task_device
    from torchloom.serve.ray_engine import replica_gpus

    assert replica_gpus("auto", replicas=2, gpus=4) == 1.0  # Ray sets each replica's CUDA_VISIBLE_DEVICES
    assert replica_gpus("cuda", replicas=3, gpus=2) == 0.66  # more replicas than GPUs: an equal share each
    assert replica_gpus("auto", replicas=2, gpus=0) == 0.0 and replica_gpus("cpu", replicas=1, gpus=8) == 0.0
    assert replica_gpus("cuda:1", replicas=2, gpus=4) == 0.0  # pinned by the user: every replica on cuda:1

    class Task:
        def __init__(self, gpus: list[str]):
            self._gpus = gpus

        def resources(self):
            return {"gpu": ResourceInformation("gpu", self._gpus)} if self._gpus else {}

    assert task_device("auto", Task(["3"])) == "cuda:3" and task_device("cuda", Task(["0"])) == "cuda:0"
    assert task_device("auto", Task([])) == "auto" and task_device("auto", None) == "auto"
    assert task_device("cpu", Task(["1"])) == "cpu" and task_device("cuda:2", Task(["1"])) == "cuda:2"
