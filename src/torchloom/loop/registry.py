"""The loop in MLflow's registry: where the champion's recipe registers its models (export.register), the candidate
is registered by its own run without the alias; promotion moves the alias (export.alias, else "champion") to it,
and every candidate's version is tagged with what the loop made of it (torchloom.loop.*). A registry that says no
is a warning: the fleet's traffic and the log's events are the record that counts."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchloom.errors import first_line
from torchloom.redaction import redact_text


def _client(cycle: dict[str, Any]):
    from mlflow import MlflowClient

    from torchloom.config.load import load_saved
    from torchloom.runs.rundir import CONFIG_FILE
    from torchloom.tracking import quiet_mlflow, resolve_uri

    quiet_mlflow()
    cfg = load_saved(Path(cycle["recipe"]) / CONFIG_FILE)
    store = resolve_uri(cfg.tracking.uri)
    return MlflowClient(tracking_uri=store, registry_uri=store), cfg.export.alias or "champion"


def move_alias(cycle: dict[str, Any], say: Callable[[str], object]) -> dict[str, str] | None:
    """The alias on the candidate's registered version ({name, alias, version, was}); None where it has none."""
    registered = cycle.get("registered")
    if not registered:
        return None
    try:
        client, alias = _client(cycle)
        name, version = registered["name"], str(registered["version"])
        try:
            was = str(client.get_model_version_by_alias(name, alias).version)
        except Exception:  # noqa: BLE001 - no version holds it yet
            was = ""
        client.set_registered_model_alias(name, alias, version)
        for key, value in (("torchloom.loop.outcome", "promoted"), ("torchloom.loop.cycle", cycle["cycle"]),
                           ("torchloom.loop.promoted_at", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())),
                           ("torchloom.loop.previous_version", was)):
            client.set_model_version_tag(name, version, key, str(value))
        return {"name": name, "alias": alias, "version": version, "was": was}
    except Exception as e:  # noqa: BLE001 - said, not fatal (module docstring)
        say(f"loop: warning: the registry did not take the promotion ({redact_text(first_line(e))[:200]})")
        return None


def restore_alias(cycle: dict[str, Any], say: Callable[[str], object]) -> None:
    """A promotion's alias (the promote event's `registry`) back on the version it was on before; none to restore
    where the promotion moved none."""
    moved = cycle.get("registry")
    if not moved or not moved.get("was"):
        return
    try:
        client, _ = _client(cycle)
        client.set_registered_model_alias(moved["name"], moved["alias"], moved["was"])
        say(f"loop: {moved['name']}@{moved['alias']} is version {moved['was']} again")
    except Exception as e:  # noqa: BLE001 - said, not fatal (module docstring)
        say(f"loop: warning: the registry did not take the alias back ({redact_text(first_line(e))[:200]})")


def tag(cycle: dict[str, Any], tags: dict[str, Any], say: Callable[[str], object]) -> None:
    """Tags on the candidate's registered version (none where it has none): what the loop made of it."""
    registered = cycle.get("registered")
    if not registered:
        return
    try:
        client, _ = _client(cycle)
        for key, value in {"torchloom.loop.cycle": cycle["cycle"], **tags}.items():
            client.set_model_version_tag(registered["name"], str(registered["version"]), key, str(value)[:4000])
    except Exception as e:  # noqa: BLE001
        say(f"loop: warning: the registry did not take the tag ({redact_text(first_line(e))[:200]})")


def recorded_run(model_path: str) -> str | None:
    """Where a champion served from the registry (models:/NAME@ALIAS, fetched into the cache) was trained: its
    version's tag torchloom.output_dir, the run export registered it from (None where there is none)."""
    import json

    from torchloom.model.served import REGISTERED_FILE

    try:
        registered = json.loads((Path(model_path) / REGISTERED_FILE).read_text())
    except (OSError, ValueError):
        return None
    try:
        from mlflow import MlflowClient

        from torchloom.tracking import quiet_mlflow, resolve_uri

        quiet_mlflow()
        store = resolve_uri("")
        version = MlflowClient(tracking_uri=store, registry_uri=store).get_model_version(registered["name"],
                                                                                         str(registered["version"]))
        return version.tags.get("torchloom.output_dir")
    except Exception:  # noqa: BLE001 - no registry to ask: the caller says to give --recipe
        return None


def registered_from(recipe: Path, run: str, say: Callable[[str], object]) -> dict[str, str] | None:
    """The version the export of `run` registered ({name, version, alias, uri}: the newest of the recipe's
    export.register tagged torchloom.output_dir `run`); None where the recipe registers none or the registry
    has none (said)."""
    try:
        client, _ = _client({"recipe": str(recipe)})
        from torchloom.config.load import load_saved
        from torchloom.runs.rundir import CONFIG_FILE

        name = load_saved(recipe / CONFIG_FILE).export.register
        if not name:
            return None
        mine = [v for v in client.search_model_versions(f"name='{name}'")
                if (v.tags or {}).get("torchloom.output_dir") == run]
    except Exception as e:  # noqa: BLE001 - said, not fatal (module docstring)
        say(f"loop: warning: the registry did not say which version {run} registered"
            f" ({redact_text(first_line(e))[:200]})")
        return None
    if not mine:
        say(f"loop: warning: no version of {name} in the registry is tagged as exported from {run}")
        return None
    version = str(max(int(v.version) for v in mine))
    return {"name": name, "version": version, "alias": "", "uri": f"models:/{name}/{version}"}
