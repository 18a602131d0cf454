"""The driver's live view of running workers: rank 0's progress bar (from the progress.json it rewrites
every log step) and every rank's log lines (from logs/rank-*.log, where the engine does not collect them)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from torchloom.poller import Poller
from torchloom.runs.runfiles import RunFiles


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


class ProgressMonitor(Poller):
    """Polls `<run>/progress.json`; a live line on a terminal, a plain line every `every` s otherwise."""

    def __init__(self, files: RunFiles, every: float = 15.0, stream=None):
        super().__init__(interval=0.5, name="torchloom-progress")
        self.rd, self.path, self.files = files.rd, files.rd.progress, files
        self._pulled = 0.0
        self.stream = stream or sys.stderr
        self.every = every
        self.tty = self.stream.isatty()
        self._last_text = ""
        self._last_print = 0.0

    def __enter__(self) -> ProgressMonitor:
        self.path.unlink(missing_ok=True)
        return super().__enter__()

    def last_poll(self) -> None:
        self.poll(final=True)
        if self.tty and self._last_text:
            self.stream.write("\n")
            self.stream.flush()

    def pull(self) -> None:
        """A run on a store whose rank 0 is on another host: its progress.json comes from the store (every 2 s;
        not while a rank on this host keeps the local file fresh)."""
        now = time.monotonic()
        if now - self._pulled < 2.0:  # a local run's pull moves nothing
            return
        self._pulled = now
        try:
            if time.time() - self.path.stat().st_mtime < 3.0:
                return
        except OSError:
            pass
        self.files.pull(self.path, quiet=True, wait=False)  # best effort, asked again in 2 s anyway

    def poll(self, final: bool = False) -> None:
        self.pull()
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


class LogTailer(Poller):
    """Copies new lines of logs/rank-*.log to the driver's stderr, each prefixed `[rankN] `. A run on a store:
    the logs of ranks on other hosts come from the store (each rank uploads its log every 10 s while it grows),
    read every 2 s into a private directory; a rank whose log grows on this host is read here."""

    def __init__(self, files: RunFiles, stream=None, interval: float = 0.5):
        super().__init__(interval=interval, name="torchloom-logs")
        self.rd, self.files = files.rd, files
        self.stream = stream or sys.stderr
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, str] = {}
        self._mirror: Path | None = None
        self._remote_sizes: dict[str, int] = {}
        self._local_ranks: set[str] = set()
        self._pulled = 0.0
        self._before: dict[str, int] = {}

    def __enter__(self) -> LogTailer:
        # Only what this launch writes: start at the current end of existing logs.
        for p in self.rd.rank_logs():
            self._offsets[p] = p.stat().st_size
        self._before = self._remote_logs()  # the store's logs before this launch (a local run lists none)
        return super().__enter__()

    def _mirrored(self) -> Path:
        """The private directory the store's logs are read into, made when the store first lists one."""
        if self._mirror is None:
            import tempfile

            self._mirror = Path(tempfile.mkdtemp(prefix="torchloom-logs-"))
            for name, size in self._before.items():
                self._offsets[self._mirror / name] = size
        return self._mirror

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._mirror is not None:
                import shutil

                shutil.rmtree(self._mirror, ignore_errors=True)

    def _remote_logs(self) -> dict[str, int]:
        listing = self.files.listing(self.rd.logs, quiet=True, wait=False)  # best effort, as the progress bar
        return {name: size for name, size in listing.items() if "/" not in name
                and name.startswith("rank-") and name.endswith(".log")}

    def _pull_remote(self) -> list[Path]:
        """The store's copies of the logs of ranks on other hosts, downloaded when they changed."""
        now = time.monotonic()
        if now - self._pulled >= 2.0:
            self._pulled = now
            for name, size in self._remote_logs().items():
                if name in self._local_ranks or self._remote_sizes.get(name) == size:
                    continue
                try:
                    self.files.download(self.rd.logs / name, self._mirrored() / name, wait=False)
                except Exception:
                    continue
                self._remote_sizes[name] = size
                if size < self._offsets.get(self._mirror / name, 0):  # another host's log of that rank now
                    self._offsets[self._mirror / name] = 0
        if self._mirror is None:
            return []
        return sorted(p for p in self._mirror.glob("rank-*.log") if p.name not in self._local_ranks)

    def poll(self) -> None:
        for p in self.rd.rank_logs():
            try:
                if self._offsets.get(p, 0) < p.stat().st_size:
                    self._local_ranks.add(p.name)  # written on this host: read here, not from the store
            except OSError:
                continue
        for p in [*(self.rd.logs / name for name in sorted(self._local_ranks)), *self._pull_remote()]:
            start = self._offsets.get(p, 0)
            try:
                with open(p, "rb") as f:
                    f.seek(start)
                    data = f.read()
            except OSError:
                continue
            if not data:
                continue
            self._offsets[p] = start + len(data)
            text = self._partial.pop(p, "") + data.decode("utf-8", errors="replace")
            lines = text.split("\n")
            if lines[-1]:
                self._partial[p] = lines[-1]
            prefix = f"[{p.stem.replace('-', '')}] "
            for line in lines[:-1]:
                self.stream.write(prefix + line + "\n")
            self.stream.flush()
