"""The driver <-> worker protocol's shared part: the files' meaning, the errors, and the readings of a
failure that a restarted worker and the driver both make.

Whatever started them, workers talk to the driver only through files in the run directory (shared
storage on a cluster), so the engines behave the same. runs/rundir.py names the files; the worker side
(engines/worker.py) writes them and the driver side (engines/driver.py) reads them:
  hooks.json                 written by the driver before a launch: reporters the workers must add
                             (e.g. an Optuna pruner), as {"reporters": [{"class": "module:Name", "args": {...}}]}
  progress.json              rewritten by rank 0 at every log step; the driver draws it (engines/progress.py)
  logs/error-rank{R}.json    a failed rank's error and traceback (the driver raises the first)
  logs/result-{launch}.json  rank 0's TrainResult of one launch
  logs/rank-{R}.log          a rank's stdout and stderr, when the engine does not collect them itself
  logs/placement-{launch}-rank{R}-start{N}.json  where rank R ran at its Nth start in this launch: a
                             second start is a restart; touched every second (a heartbeat). A rank that
                             left no error file, was not stopped by its launcher ("stopped": true,
                             written on SIGTERM) and whose heartbeat ended well before the others' was lost
"""

from __future__ import annotations

import dataclasses

from torchloom.errors import UserError
from torchloom.jsonio import read_json
from torchloom.runs.rundir import RunDir
from torchloom.runs.runfiles import RunFiles


class TrainingFailed(Exception):
    """A worker failed; the message carries that rank's traceback."""

    exit_code = 1


class Preempted(Exception):
    """The launcher itself was told to stop (its host is taken back): the workers stopped after the same
    step with a checkpoint, and nothing is left here to go on with. The message is one line."""

    exit_code = 75  # EX_TEMPFAIL: the same command with --resume goes on (train/preemption.EXIT_PREEMPTED)


class RestartLimit(RuntimeError):
    """A worker refused to start again: the job already used its restarts."""


class NotRestarted(RuntimeError):
    """A worker refused to start again: a rank failed with an error of its own, which a restart repeats."""


class RunDirNotVisible(UserError):
    """This host does not see the run directory the driver prepared (no shared storage, another path)."""


def not_visible(files: RunFiles, hosts: list[str]) -> RunDirNotVisible:
    rd = files.rd
    if files.on_store:  # the meaning differs: a store's run is reached with credentials, a local one by a mount
        return RunDirNotVisible(
            f"output.dir {rd.where}: the store's prepared data ({rd.home(rd.manifest)}) cannot be read from"
            f" host{'s' if len(hosts) > 1 else ''} {', '.join(hosts)}; give those hosts {files.what_to_check()}")
    return RunDirNotVisible(
        f"output.dir {rd.root}: not visible on host{'s' if len(hosts) > 1 else ''} {', '.join(hosts)} (no"
        f" {rd.manifest.relative_to(rd.root)} there); put the run directory on storage every host mounts at the same"
        " path")


def replace_engine(cfg, **changes):
    """A copy of cfg with engine fields changed (the caller's config stays as the user gave it)."""
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, **changes))


# Each rank touches its placement file every HEARTBEAT_S from a thread of its own (which runs while
# the training thread waits in a collective); a rank whose touches stopped LOST_AFTER_S before the
# last of its attempt's did not simply fail with the others: its process or host went away.
HEARTBEAT_S = 1.0
LOST_AFTER_S = 3.0  # under the smallest engine.collective_timeout_s (5), less a beat each side
# A run on a store: hosts share no file whose time they could touch, so each rank writes its beat's time into
# its placement file and uploads it every REMOTE_BEAT_S; a beat that reached the store counts.
REMOTE_BEAT_S = 2.0
REMOTE_LOG_S = 10.0  # a run on a store: how often a rank uploads its log when it grew (engines/worker.py)


def lost_ranks(files: RunFiles, launch_id: str, start: int) -> list[dict]:
    """The ranks of the given start of this launch that vanished: they left no error of their own (a
    failing rank records one before it leaves), were not stopped by their launcher, and their heartbeat
    ended well before the others' (as when a host dies or is cut off, and the others wait for it). On a store
    the beats are the times the ranks uploaded in their placement files (the hosts' clocks, kept in step by
    NTP as on any cluster)."""
    rd = files.rd
    paths = rd.placements(launch_id, start)
    files.refresh(*paths, quiet=True, wait=False)  # a store that does not answer now: judge by what this host has
    remote = files.on_store  # the meaning differs: hosts sharing no directory share no file times (beats in the files)
    placed = []
    for p in paths:
        try:
            info = read_json(p)
            beat = float(info.get("beat") or info.get("time") or 0) if remote else p.stat().st_mtime
            placed.append((info, beat))
        except (OSError, ValueError, TypeError):
            continue
    if not placed:
        return []
    last = max(beat for _, beat in placed)
    after = LOST_AFTER_S + (REMOTE_BEAT_S if remote else 0.0)
    return [info for info, beat in placed
            if not info.get("stopped") and not rd.error_file(info["rank"]).exists() and last - beat > after]


def describe_loss(files: RunFiles, launch_id: str, start: int) -> str:
    lost = lost_ranks(files, launch_id, start)
    if not lost:
        return ""
    return "; ".join(f"rank {p['rank']} on host {p['host']} stopped answering (lost)" for p in lost)


PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "gloo/transport",
             "NCCL communicator was aborted", "Socket Timeout", "collective operation timeout",
             "Failed to recv, got 0 bytes", "wait timeout after",
             # gloo closes a pair whose operation timed out (a peer that went away, met first by the preemption
             # flags summed in the background: train/distributed.AgreedLater); the next collective on it says so
             "Application timeout caused pair closure")
# A rank's own error that says nothing of its cause: the launcher's refusals, or a stop it was sent.
NOT_A_CAUSE = ("RestartLimit", "NotRestarted")


def is_peer_loss(message: str) -> bool:
    """A collective that failed because another rank went away: a consequence, not a cause."""
    return any(p in message for p in PEER_LOSS)


def failure_cause(rd: RunDir, launch_id: str) -> dict | None:
    """The error a rank of this launch recorded of its own (not a peer's loss seen in a collective, not
    a refusal to restart): a deterministic failure, which a restart would repeat. None: the ranks that
    failed only lost peers, or vanished without a word (a killed process, a lost host): restartable."""
    causes = []
    for p in rd.error_files():
        try:
            e = read_json(p)
        except (OSError, ValueError):
            continue
        # transient: the store did not answer for its whole retry window (storage.StoreUnavailable), which a
        # restart may find mended, like a lost host
        if (e.get("launch") == launch_id and e["type"] not in NOT_A_CAUSE and not is_peer_loss(e["message"])
                and not e.get("transient")):
            causes.append(e)
    return min(causes, key=lambda e: (e.get("time", 0.0), e["rank"])) if causes else None
