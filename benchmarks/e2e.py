"""`torchloom run` on the demo against the same fine-tune written with the plain HF Trainer.

    .venv/bin/python benchmarks/e2e.py [--skip-hf]

Runs, in this order and in one sitting: `torchloom run` (Spark start-up, prepare, train, export,
evaluate) into a fresh run dir, then benchmarks/hf_trainer.py on the same split, both with precision auto
(torchloom's rule: bf16 only where the CPU runs it natively). Prints the CPU first: write it beside
every figure. Prints wall time and
test accuracy side by side with the ratio. Needs `accelerate` for the HF Trainer (pip install accelerate).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", default=os.path.join(tempfile.gettempdir(), "torchloom-bench", "e2e"))
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("extra", nargs="*", help="extra torchloom overrides, e.g. --train.lr=1e-4")
    a = p.parse_args()
    if not a.skip_hf and importlib.util.find_spec("accelerate") is None:
        # Before the 4-minute torchloom run, not after it: the HF Trainer refuses to start without it.
        sys.exit("benchmarks/e2e.py: the HF Trainer baseline needs accelerate; install it with"
                 " .venv/bin/pip install -c constraints.txt -e '.[bench]' (or pass --skip-hf)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from torchloom.embedded import demo_model_path
    from torchloom.machine import cpu

    print(f"cpu: {cpu().describe()}", flush=True)
    run_dir = Path(a.run_dir)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torchloom", "run", "--output.dir", str(run_dir), "--overwrite", *a.extra],
                   check=True, cwd=ROOT)
    tl_wall = time.perf_counter() - started
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [(f"torchloom run ({summary.get('precision', '?')}; prepare+train+export+evaluate)", tl_wall,
             summary["accuracy"], summary["timings"])]
    if not a.skip_hf:
        out = run_dir.parent / "hf.json"
        started = time.perf_counter()
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hf_trainer.py"), str(run_dir / "data"),
                        demo_model_path(), str(out)], check=True, cwd=ROOT)
        hf_wall = time.perf_counter() - started
        hf = json.loads(out.read_text())
        rows.append((f"HF Trainer script, 1 process, {hf.get('precision', '?')} (baseline)", hf_wall, hf["accuracy"],
                     {"train_s": hf["train_s"]}))
    base = rows[-1][1]
    print(f"\n{'what':48} {'wall s':>7} {'x baseline':>11} {'test acc':>9}  stages")
    for name, wall, acc, timings in rows:
        stages = " ".join(f"{k[:-2]}={v:.0f}s" for k, v in timings.items() if k.endswith("_s") and k != "total_s")
        print(f"{name:48} {wall:7.1f} {wall / base:11.3f} {acc:9.4f}  {stages}")


if __name__ == "__main__":
    main()
