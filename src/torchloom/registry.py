"""Models by name: MLflow's model registry.

- `torchloom export --register NAME [--alias champion]` (export.register, export.alias): the exported model, logged
  to the run's MLflow run as a pyfunc model, becomes a new version of NAME, tagged with the run's directory, the
  data's fingerprint and version and the validation metrics (a `torchloom run` adds the test metrics); the alias
  moves to it.
- `models:/NAME@alias`, `models:/NAME/VERSION` or `models:/NAME/latest` (its newest version), given to predict,
  serve or monitor where a model directory goes: the version's model is downloaded once into torchloom's private
  cache (keyed by the registry, the name, the version and its run) and loaded from there, with its identity beside
  it (REGISTERED_FILE: name, version, aliases, run), which a server answers as and labels its metrics with. The
  registry is the tracking store: --tracking-uri, else $MLFLOW_TRACKING_URI, else ./mlflow.db, as tracking.uri.
- A pinned version (`models:/NAME/VERSION`) already in the cache is served from it while the registry does not
  answer, with one warning; an alias or `latest` needs the registry (what it names may have moved).
A model that is not registered, an unknown alias or version, or a registry that does not answer: one line each;
a lookup never creates a registry (no ./mlflow.db where there was none).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from torchloom.errors import UserError, clipped, first_line, install_hint
from torchloom.jsonio import write_atomic
from torchloom.redaction import redact_text

PREFIX = "models:/"


def register(tracker, model_dir: Path, name: str, alias: str, tags: dict) -> dict:
    """`model_dir` logged to the tracker's run and registered as a new version of `name` (created when new), with
    `tags`; `alias` set on it. {name, version, alias, uri}; a registry that refuses is one line."""
    if not tracker.enabled:
        raise UserError(f"export.register {name}: registering a model needs MLflow tracking; leave tracking.enabled"
                        f" true ({install_hint('track')} where MLflow is missing)")
    from torchloom.mlflow_model import log_model

    client, where = tracker.client, tracker.shown_uri
    try:
        log_model(tracker, Path(model_dir))
        try:
            client.create_registered_model(name, description="registered by torchloom export")
        except Exception as e:  # noqa: BLE001 - an existing model takes a new version
            if getattr(e, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
                raise
        version = client.create_model_version(name, source=f"runs:/{tracker.run_id}/model", run_id=tracker.run_id,
                                              tags={k: str(v) for k, v in tags.items()})
        if alias:
            client.set_registered_model_alias(name, alias, version.version)
    except Exception as e:  # noqa: BLE001 - one line, whatever the store says
        why = clipped(redact_text(first_line(e)), 200)
        raise UserError(f"export.register {name}: the registry at {where} did not take the model ({why}); the"
                        f" exported model is in {model_dir}") from None
    return {"name": name, "version": str(version.version), "alias": alias,
            "uri": f"{PREFIX}{name}@{alias}" if alias else f"{PREFIX}{name}/{version.version}"}


def tag_version(tracker, name: str, version: str, tags: dict) -> None:
    """More tags on a registered version (the test metrics, once evaluate has them); a failure is a warning."""
    for k, v in tags.items():
        tracker._guard(f"the registered version's tag {k}", tracker.client.set_model_version_tag, name, version, k,
                       str(v))


def parse(uri: str) -> tuple[str, str, str]:
    """models:/NAME@alias -> (NAME, "alias", alias); models:/NAME/3 -> (NAME, "version", "3"); models:/NAME/latest
    -> (NAME, "latest", "latest"): its newest version, as MLflow reads it."""
    rest = uri[len(PREFIX):].strip("/")
    if "@" in rest:
        name, _, alias = rest.rpartition("@")
        if name and alias:
            return name, "alias", alias
    else:
        name, _, version = rest.rpartition("/")
        if name and version.isdigit():
            return name, "version", version
        if name and version == "latest":
            return name, "latest", version
    raise UserError(f"{uri}: not a registered model's URI; use models:/NAME@ALIAS, models:/NAME/VERSION or"
                    " models:/NAME/latest")


def local_copy(uri: str, what: str) -> str:
    """A model as a directory on this host: a registered version (models:/NAME@ALIAS, models:/NAME/VERSION) through
    fetch, a store's URI through model_cache.fetch_model (a run on a store for its model/ too), a local path as
    it is."""
    from torchloom.uri import is_uri

    if uri.startswith("models:/"):
        return str(fetch(uri, what))
    if is_uri(uri):
        from torchloom.model_cache import fetch_model

        return str(fetch_model(uri, what))
    return uri


def fetch(uri: str, what: str) -> Path:
    """A registered model's exported directory, downloaded once into the private cache (the cache is keyed by the
    registry, the name, the version and its run, so a moved alias fetches its new version)."""
    try:
        from mlflow import MlflowClient
    except ImportError:
        raise UserError(f"{what} {uri}: loading a registered model needs MLflow; {install_hint('track')}") from None
    from torchloom.model.served import REGISTERED_FILE
    from torchloom.model_cache import fill_once
    from torchloom.tracking import quiet_mlflow, resolve_uri

    quiet_mlflow()
    name, kind, ref = parse(uri)
    store = resolve_uri("")
    if store.startswith("sqlite:///") and not Path(store[len("sqlite:///"):]).is_file():  # a read creates nothing
        raise UserError(f"{what} {uri}: no registry at {store} (no such file); set --tracking-uri (or"
                        " MLFLOW_TRACKING_URI) to the registry the model was registered in")
    # a registry that does not answer is said at once, not after MLflow's default minutes of retries
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    try:
        client = MlflowClient(tracking_uri=store, registry_uri=store)
    except ValueError as e:  # a URL its parser refuses (a `[` in a password not percent-encoded)
        raise UserError(f"{what} {uri}: the tracking URI {redact_text(store)} is not a URL MLflow reads"
                        f" ({redact_text(e)}); percent-encode what its password holds (e.g. [ as %5B)") from None
    try:
        version = _version(client, uri, what, store, name, kind, ref)
    except RegistryDown as e:
        cached = _pinned(store, name, ref) if kind == "version" else None
        if cached is None:
            raise UserError(str(e)) from None
        print(f"torchloom: {what} {uri}: warning: {e.why}; serving version {ref} of {name} from the cache",
              file=sys.stderr, flush=True)
        return cached
    key = hashlib.sha256(f"{redact_text(store)}\n{name}\n{version.version}\n{version.run_id}".encode()).hexdigest()[:20]
    if not version.run_id:
        raise UserError(f"{what} {uri}: version {version.version} of {name} names no MLflow run; torchloom loads the"
                        " versions `torchloom export --register` made (load others with mlflow.pyfunc)")

    def fill(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        try:
            client.download_artifacts(version.run_id, "model", str(tmp))
        except Exception as e:  # noqa: BLE001
            raise UserError(f"{what} {uri}: version {version.version} of {name}: its model could not be downloaded"
                            f" from {redact_text(store)} ({clipped(redact_text(first_line(e)), 200)})") from None
        (tmp / ".torchloom-complete").write_text(f"{name} {version.version} {version.run_id}\n")

    target = fill_once("registry", key, lambda entry: (entry / ".torchloom-complete").is_file(), fill)
    model = _model_dir(target, uri, what)
    # who the model is, beside it (model/served.py reads it): the aliases as the registry has them now
    write_atomic(model / REGISTERED_FILE, json.dumps({
        "name": name, "version": str(version.version), "aliases": sorted(getattr(version, "aliases", None) or []),
        "run_id": version.run_id, "registry": redact_text(store)}))
    write_atomic(_pin_file(store, name, str(version.version)), str(model))
    print(f"torchloom: {what} {uri}: version {version.version} of {name} (run {version.run_id}), from"
          f" {redact_text(store)}", file=sys.stderr, flush=True)
    return model


class RegistryDown(Exception):
    """The registry did not answer: the line to say, and why (for the warning of a version served from the cache)."""

    def __init__(self, line: str, why: str) -> None:
        super().__init__(line)
        self.why = why


def _pin_file(store: str, name: str, version: str) -> Path:
    """Where the cache says which entry holds a registry's version of a model (read while the registry is down)."""
    from torchloom.runs.rundir import cache_root

    key = hashlib.sha256(f"{redact_text(store)}\n{name}\n{version}".encode()).hexdigest()[:20]
    return cache_root() / "registry" / f".pin-{key}"


def _pinned(store: str, name: str, version: str) -> Path | None:
    """A version of a model this cache holds whole, by a pin file an earlier fetch wrote; None otherwise."""
    from torchloom.model.served import REGISTERED_FILE

    pin = _pin_file(store, name, version)
    try:
        model = Path(pin.read_text().strip())
    except OSError:
        return None
    entry = next((p for p in model.parents if p.parent == pin.parent), None)
    if entry is None or not (entry / ".torchloom-complete").is_file() or not (model / REGISTERED_FILE).is_file():
        return None
    return model


def _version(client, uri: str, what: str, store: str, name: str, kind: str, ref: str):
    where = redact_text(store)
    try:
        if kind == "alias":
            return client.get_model_version_by_alias(name, ref)
        if kind == "latest":
            client.get_registered_model(name)  # a name not registered: said as below
            found = client.search_model_versions(f"name = '{name}'")
            if not found:
                raise UserError(f"{what} {uri}: model {name!r} has no version at {where}; register one with"
                                f" torchloom export --register {name}")
            return max(found, key=lambda v: int(v.version))
        return client.get_model_version(name, ref)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - each way it fails, one line
        code = getattr(e, "error_code", "")
        if code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            try:
                model = client.get_registered_model(name)
            except Exception:  # noqa: BLE001
                raise UserError(f"{what} {uri}: no model {name!r} is registered at {where}; register one with"
                                f" torchloom export --register {name}, or set --tracking-uri to its registry") from None
            aliases = sorted(getattr(model, "aliases", {}) or {})
            if kind == "alias":
                known = f"its aliases: {', '.join(aliases)}" if aliases else "it has no alias"
                raise UserError(f"{what} {uri}: model {name!r} has no alias {ref!r} ({known}); set one with torchloom"
                                f" export --register {name} --alias {ref}") from None
            raise UserError(f"{what} {uri}: model {name!r} has no version {ref}; see its versions in MLflow, or use"
                            f" models:/{name}@ALIAS") from None
        why = f"the registry at {where} does not answer ({clipped(redact_text(first_line(e)))})"
        raise RegistryDown(f"{what} {uri}: {why}; start it, or set --tracking-uri (or MLFLOW_TRACKING_URI) to the"
                           " right one", why) from None


def _model_dir(root: Path, uri: str, what: str) -> Path:
    """The exported Hugging Face directory inside a downloaded pyfunc model (its `model_dir` artifact)."""
    import yaml

    mlmodel = root / "model" / "MLmodel"
    try:
        flavors = yaml.safe_load(mlmodel.read_text())["flavors"]["python_function"]
        path = root / "model" / flavors["artifacts"]["model_dir"]["path"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        raise UserError(f"{what} {uri}: the registered model is not one torchloom logged (no model_dir artifact in"
                        " its MLmodel); load it with mlflow.pyfunc instead") from None
    inside = (root / "model").resolve()
    if not path.resolve().is_relative_to(inside):  # `../..` or an absolute path: a directory outside the download
        raise UserError(f"{what} {uri}: its MLmodel names a model directory outside the downloaded model"
                        f" ({flavors['artifacts']['model_dir']['path']!r}); it is not one torchloom logged; register"
                        " the model again with torchloom export --register")
    return path
