"""Experiment tracking in MLflow: one MLflow run per training job, whatever engine runs it.

The driver (the `torchloom` process) opens the run, logs the flattened config as params and the
tags, and later the artifacts, the summary metrics and the exported model as an MLflow pyfunc
model. Per-step metrics are what rank 0 writes to metrics.jsonl in the run directory: the driver
forwards new lines every few seconds (MetricsForwarder), so workers never import MLflow and training
never waits on the tracking store.
Nested runs: a tune study's run is the parent of one run per trial.

Store: `tracking.uri` if given, else $MLFLOW_TRACKING_URI, else `sqlite:///<cwd>/mlflow.db` with
artifacts beside it in mlartifacts/ (mlflow-skinny has no plain file store). A bare path is read as
a directory to keep mlflow.db in, or as the database file when it ends in .db.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from torchloom.config import Config, to_dict
from torchloom.errors import UserError, first_line, install_hint
from torchloom.poller import Poller
from torchloom.redaction import redact_config, redact_text

SCHEMES = ("sqlite:", "http:", "https:", "databricks", "postgresql", "mysql", "mssql")


def resolve_uri(uri: str) -> str:
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri:
        return f"sqlite:///{Path.cwd() / 'mlflow.db'}"
    if uri.startswith("file:"):
        uri = uri[len("file:"):].lstrip("/")
        uri = "/" + uri
    if uri.startswith(SCHEMES):
        return uri
    p = Path(uri).expanduser().resolve()
    return f"sqlite:///{p if p.suffix == '.db' else p / 'mlflow.db'}"


def artifact_root(uri: str) -> str | None:
    """Where a new experiment keeps artifacts: beside a sqlite database; else the server decides."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").as_uri()
    return None


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and key.count(".") < 1:
            out.update(flatten(v, key + "."))
        else:
            out[key] = str(v)[:6000]
    return out


def git_commit(cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def metric_items(record: dict) -> dict[str, float]:
    """A metrics.jsonl record as MLflow metrics: train_* per logged step, val_* per evaluation, checkpoint_*
    per checkpoint uploaded to a store (bytes, blocked_s, upload_s)."""
    prefix = {"eval": "val_", "checkpoint": "checkpoint_"}.get(record.get("kind"), "train_")
    out = {}
    for k, v in record.items():
        if k in ("kind", "step") or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        name = k if k in ("lr", "epoch", "grad_norm", "samples_per_s") else prefix + k
        out[name] = float(v)
    return out


def quiet_mlflow() -> None:
    import logging

    for name in ("mlflow", "alembic", "mlflow.store.db.utils"):
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


class NullTracker:
    enabled = False
    run_id = None
    uri = None

    def set_tags(self, tags: dict) -> None:
        pass

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        pass

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        pass

    def log_model(self, model_dir: str | Path) -> None:
        pass

    def log_input(self, inputs: dict, digest: str, rows: int) -> None:
        pass

    def finish(self, status: str = "FINISHED") -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        pass


class Tracker(NullTracker):
    """The driver's handle on one MLflow run."""

    enabled = True

    def __init__(self, client, uri: str, experiment_id: str, run_id: str, cfg: Config):
        self.client, self.uri, self.experiment_id, self.run_id, self.cfg = client, uri, experiment_id, run_id, cfg
        self._finished = False

    @property
    def shown_uri(self) -> str:
        """The store's URI as lines and files show it: no user:password@."""
        return redact_text(self.uri)

    @classmethod
    def start(cls, cfg: Config, kind: str, run_name: str | None = None, parent: Tracker | None = None,
              extra_tags: dict | None = None, parent_run_id: str | None = None, params: bool = True) -> NullTracker:
        """params: log the config as the run's params (not for a run that trains nothing, as `monitor`'s)."""
        tracking_cfg = cfg.tracking
        if not tracking_cfg.enabled:
            return NullTracker()
        try:
            from mlflow import MlflowClient
        except ImportError:
            if tracking_cfg.uri:
                raise UserError(f"tracking.uri is set but MLflow is not installed; {install_hint('track')}"
                                " or pass --tracking.enabled false") from None
            print("torchloom: tracking: MLflow is not installed, so this run is not tracked"
                  f" ({install_hint('track')}; --tracking.enabled false silences this)", file=sys.stderr)
            return NullTracker()
        uri = _prepared_uri(tracking_cfg.uri)
        try:
            client = MlflowClient(tracking_uri=uri)
            exp = client.get_experiment_by_name(tracking_cfg.experiment)
            if exp is None:
                try:
                    exp_id = client.create_experiment(tracking_cfg.experiment, artifact_location=artifact_root(uri))
                except Exception:  # another process created it meanwhile
                    exp = client.get_experiment_by_name(tracking_cfg.experiment)
                    if exp is None:
                        raise
                    exp_id = exp.experiment_id
            else:
                exp_id = exp.experiment_id
            from torchloom import __version__

            tags = {
                "torchloom.kind": kind,
                "torchloom.version": __version__,
                "engine": cfg.engine.name,
                "world_size": str(cfg.engine.workers),
                **(extra_tags or {}),
            }
            commit = git_commit()
            if commit:
                tags["mlflow.source.git.commit"] = commit
            if parent is not None and parent.enabled:
                parent_run_id = parent.run_id
            if parent_run_id:
                tags["mlflow.parentRunId"] = parent_run_id
            name = run_name or tracking_cfg.run_name or Path(cfg.output.dir).name
            run = client.create_run(exp_id, run_name=name, tags=tags)
        except UserError:
            raise
        except Exception as e:
            first = first_line(e)
            raise UserError(f"tracking.uri {uri}: cannot use this MLflow store ({first[:200]}); start the server,"
                            " fix the URI, or pass --tracking.enabled false") from None
        tracker = cls(client, uri, exp_id, run.info.run_id, cfg)
        if params:
            tracker._guard("the config as params", tracker.log_params, redact_config(to_dict(cfg)))
        return tracker

    def _guard(self, what: str, fn, *args) -> None:
        """Tracking never costs the user a finished training: a failing store is a warning."""
        try:
            fn(*args)
        except Exception as e:
            first = first_line(e)
            print(f"torchloom: tracking: could not log {what} to {self.shown_uri} ({first[:200]})", file=sys.stderr)

    def log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in sorted(flatten(params).items())]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def set_tags(self, tags: dict) -> None:
        for k, v in tags.items():
            self._guard(f"tag {k}", self.client.set_tag, self.run_id, k, str(v))

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if items:
            self._guard("metrics", self.client.log_batch, self.run_id, items)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        p = Path(path)
        if p.is_dir():
            self._guard(p.name, self.client.log_artifacts, self.run_id, str(p), artifact_path)
        elif p.is_file():
            self._guard(p.name, self.client.log_artifact, self.run_id, str(p), artifact_path)

    def log_input(self, inputs: dict, digest: str, rows: int) -> None:
        """The prepared data's input (a manifest's `inputs`) as the run's input dataset, in the context "training":
        a Delta or Iceberg table with the version read (source types delta_table, iceberg_table), else its path."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        fmt, path = inputs.get("format", ""), str(inputs.get("path", ""))
        source = {"path": path, "format": fmt,
                  **{k: inputs[k] for k in ("version", "committed") if k in inputs}}
        if fmt == "delta":
            source["delta_table_version"] = inputs.get("version")
        dataset = Dataset(name=path.rstrip("/").rsplit("/", 1)[-1] or path, digest=digest[:32],
                          source_type={"delta": "delta_table", "iceberg": "iceberg_table"}.get(fmt, "path"),
                          source=json.dumps(source), profile=json.dumps({"num_rows": rows}))
        self._guard("the input dataset", self.client.log_inputs, self.run_id,
                    [DatasetInput(dataset, [InputTag("mlflow.data.context", "training")])])

    def log_model(self, model_dir: str | Path) -> None:
        """The exported model as an MLflow pyfunc model: `mlflow models serve -m runs:/<id>/model`."""
        from torchloom.mlflow_model import log_model

        self._guard("the model", log_model, self, Path(model_dir))

    def finish(self, status: str = "FINISHED") -> None:
        if not self._finished:
            self._finished = True
            self._guard("the run's end", self.client.set_terminated, self.run_id, status)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish("FINISHED")
        else:
            self.finish("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")


def _prepared_uri(uri: str) -> str:
    """The store's URI, resolved; MLflow quietened; a SQLite store's folder made."""
    quiet_mlflow()
    uri = resolve_uri(uri)
    if redact_text(uri) != uri:  # MLflow's own "View run at" line would show the password
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    return uri


def start(cfg: Config, kind: str, **kwargs) -> NullTracker:
    return Tracker.start(cfg, kind, **kwargs)


class MetricsForwarder(Poller):
    """Copies the records rank 0 appends to metrics.jsonl into the driver's MLflow run, every few seconds.

    The driver already has MLflow loaded; a worker would have to import it (about 2 s of a core on
    rank 0 while the other ranks wait for it at the first collective) and hold a store connection.

    Only records past `after_step` go out (on a resume, the checkpoint's step: earlier records were
    this log's history, tracked by the run that wrote them), and each (kind, step) once: a worker
    restarted from a checkpoint rewrites the file and logs steps after it again.
    """

    def __init__(self, client, run_id: str, metrics_path: str | Path, after_step: int = -1, interval: float = 2.0):
        super().__init__(interval, name="torchloom-mlflow", join_timeout=60)
        self.client, self.run_id = client, run_id
        self.path, self.after_step = Path(metrics_path), after_step
        self.sent: set[tuple[str, int]] = set()
        self.failed = False
        self._file: tuple[int, int] = (-1, 0)  # (inode, bytes read): only new lines are parsed

    def _new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                # The log is rewritten (a new file) when a worker resumes: read it again from the start.
                offset = self._file[1] if inode == self._file[0] else 0
                f.seek(offset)
                data = f.read()
        except OSError:
            return []  # not written yet
        complete = data[:data.rfind(b"\n") + 1]  # a last line still being written waits for the next poll
        self._file = (inode, offset + len(complete))
        return complete.decode("utf-8", errors="replace").splitlines()

    def poll(self) -> None:
        if self.failed:
            return
        lines = self._new_lines()
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics, keys = [], []
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            key = (record.get("kind", ""), int(record.get("step", 0)))
            if key[1] <= self.after_step or key in self.sent:
                continue
            keys.append(key)
            metrics += [Metric(k, v, now, key[1]) for k, v in metric_items(record).items()]
        try:
            for i in range(0, len(metrics), 1000):
                self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])
        except Exception as e:  # never fail training over tracking
            self.failed = True
            first = first_line(e)
            print(f"torchloom: tracking: MLflow logging of step metrics stopped ({first[:200]}); training goes on",
                  file=sys.stderr, flush=True)
            return
        self.sent.update(keys)


def forward_missing(client, run_id: str, metrics_path: str | Path) -> None:
    """Log the records of metrics_path that the run lacks: for a process killed before its
    forwarder's last poll (a trial Ray Tune's scheduler stopped), called by whoever outlives it."""
    forwarder = MetricsForwarder(client, run_id, metrics_path)
    # Every train and eval record carries a loss: the steps logged so far, per kind.
    for kind, name in (("train", "train_loss"), ("eval", "val_loss")):
        forwarder.sent.update((kind, m.step) for m in client.get_metric_history(run_id, name))
    forwarder.poll()
