"""benchmarks/gpu.py, the one-GPU script of issue 48: its dry run (`--device cpu --tiny`) runs every code path on a
CPU with tiny models (each training side, serving, the table, --save, --write and --record) and prints a table
with every row. Nothing here needs a GPU: this runs in CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu.py"
TITLE = "## On a GPU (benchmarks/gpu.py)"
TRAINING = ("training: bare loop (baseline)", "training: torchloom train", "training: HF Trainer")
SERVING = ("serving: offline", "serving: torchloom serve, c=1", "serving: torchloom serve, c=8",
           "serving: torchloom serve, c=64")


def gpu_script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def table_rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| what")]


def test_the_dry_run_prints_a_row_for_every_side_and_records_the_table(tmp_path):
    doc, saved = tmp_path / "benchmarks.md", tmp_path / "gpu.md"
    doc.write_text("# Benchmarks\n\n## Serving\n\nkept as it was\n", encoding="utf-8")
    out = gpu_script("--device", "cpu", "--tiny", "--write", "--doc", str(doc), "--save", str(saved)).stdout

    rows = table_rows(out)
    names = [(r[0], r[1]) for r in rows]
    for model in ("MiniLM", "BERT-base"):
        for side in TRAINING:
            assert sum(what.startswith(side) and model in m for what, m in names) == 1, (side, model, names)
    for side in SERVING:
        assert sum(what.startswith(side) for what, _ in names) == 1, (side, names)
    assert len(rows) == 2 * len(TRAINING) + len(SERVING)
    for row in rows:
        what, _, rate, tokens, tflops, mfu, ratio, notes, device, cpu = row
        assert float(rate.split()[0]) > 0 and float(tokens) > 0 and float(tflops) >= 0, row
        assert mfu == "-", row  # no peak is known for a CPU: never a guess
        assert float(ratio) == 1.0 if "baseline" in what else float(ratio) >= 0, row  # 0.00 at c=1 on a busy CPU
        assert device == "no GPU (CPU)" and cpu, row
        assert ", 0 errors," in notes if "torchloom serve" in what else notes, row
    assert "Checks:" in out and "Goals (issue 48):" in out

    section = saved.read_text(encoding="utf-8")
    assert section.startswith("### ") and "dry run" in section and section.strip() in out
    text = doc.read_text(encoding="utf-8")
    assert "## Serving\n\nkept as it was\n" in text and text.count(TITLE) == 1 and section.strip() in text

    # --record (what brings a lent machine's --save home): the new run first, the earlier kept, one intro
    again = section.replace("### ", "### again: ", 1)
    saved.write_text(again, encoding="utf-8")
    gpu_script("--record", str(saved), "--doc", str(doc))
    text = doc.read_text(encoding="utf-8")
    assert text.count(TITLE) == 1 and text.count("Newest run first") == 1
    assert text.index(again.strip()) < text.index(section.strip()) and "kept as it was" in text


def test_write_refuses_a_dry_run_into_the_real_document():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--write"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "a dry run is not a measurement" in proc.stderr
