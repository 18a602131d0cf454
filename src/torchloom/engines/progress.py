"""The driver's live progress bar, drawn from the progress.json that rank 0 rewrites every log step."""

from __future__ import annotations

import json
import sys
import threading
import time

from torchloom.rundir import RunDir


def fmt_time(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 60}:{seconds % 60:02d}" if seconds < 3600 else f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def render(p: dict) -> str:
    step, total = p.get("step", 0), max(1, p.get("total_steps", 1))
    if p.get("phase") == "eval":
        return f"epoch {p.get('epoch', 0):.2f} step {step}/{total} evaluating..."
    filled = int(20 * step / total)
    bar = "#" * filled + "." * (20 - filled)
    return (f"[{bar}] epoch {p.get('epoch', 0):.2f} step {step}/{total} loss {p.get('loss', float('nan')):.4f}"
            f" lr {p.get('lr', 0):.2e} {p.get('samples_per_s', 0):.1f} samples/s ETA {fmt_time(p.get('eta_s', 0))}")


class ProgressMonitor:
    """Polls `<run>/progress.json`; a live line on a terminal, a plain line every `every` s otherwise."""

    def __init__(self, rd: RunDir, every: float = 15.0, stream=None):
        self.path = rd.progress
        self.stream = stream or sys.stderr
        self.every = every
        self.tty = self.stream.isatty()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._last_text = ""
        self._last_print = 0.0

    def __enter__(self) -> ProgressMonitor:
        self.path.unlink(missing_ok=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._poll(final=True)
        if self.tty and self._last_text:
            self.stream.write("\n")
            self.stream.flush()

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            self._poll()

    def _poll(self, final: bool = False) -> None:
        try:
            text = render(json.loads(self.path.read_text()))
        except (OSError, ValueError):
            return
        if text == self._last_text:
            return
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r\033[K" + text)
        elif final or now - self._last_print >= self.every:
            self.stream.write(text + "\n")
            self._last_print = now
        else:
            return
        self._last_text = text
        self.stream.flush()
