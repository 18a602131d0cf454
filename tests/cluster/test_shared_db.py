"""One study, many machines (issue 60): hosts that share nothing but a database host, which runs PostgreSQL (Debian's,
support/postgres.py), an S3 server (moto's) and `mlflow server` with PostgreSQL as its backend store and S3 as its
artifact store, as a platform team runs them.

- Two hosts run `torchloom tune` on one Optuna study in PostgreSQL, each with its own study directory (hidden
  from the other) and its own cache: the study holds exactly tune.trials finished trials, each configuration once,
  run on both hosts; every trial is a nested MLflow run on the server, logged from the host that ran it.
- One host registers its best trial's model by name with an alias; the other serves `models:/NAME@champion` with
  an empty cache, fetched through the MLflow server from the S3 store.
Every process runs inside the namespaces; the studies start from data prepared beforehand (no Spark).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from support.postgres import Postgres
from support.runs import prepared_study

from cluster.netns import Cluster, skip_without_namespaces
from cluster.s3_scripts import BUCKET as MAKE_BUCKET
from cluster.test_multihost import clean_env, torchloom

pytestmark = pytest.mark.cluster  # see tests/support/schedule.py
pytest.importorskip("optuna")
pytest.importorskip("psycopg")
pytest.importorskip("mlflow")
pytest.importorskip("moto")
skip_without_namespaces()

BUCKET = "tl-mlflow"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "db-key", "AWS_SECRET_ACCESS_KEY": "db-secret", "AWS_DEFAULT_REGION": "us-east-1"}
TRIALS = 3
SPACE = '{"train.lr" = "loguniform(1e-4, 1e-2)", "train.warmup_ratio" = "uniform(0, 0.2)"}'

# Run on the database host: the study's trials and the MLflow server's runs and registered versions, as JSON.
INSPECT = """
import json, sys
import optuna
from mlflow import MlflowClient
study = optuna.load_study(study_name=sys.argv[3], storage=sys.argv[1])
client = MlflowClient(tracking_uri=sys.argv[2])
exp = client.get_experiment_by_name("torchloom")
runs = client.search_runs([exp.experiment_id], max_results=1000) if exp else []
print(json.dumps({
    "trials": [{"number": t.number, "state": t.state.name, "params": t.params, "attrs": t.user_attrs}
               for t in study.trials],
    "runs": [{"name": r.info.run_name, "kind": r.data.tags.get("torchloom.kind"),
              "parent": r.data.tags.get("mlflow.parentRunId"), "id": r.info.run_id,
              "metrics": sorted(r.data.metrics)} for r in runs],
}))
"""


def wait_until(what: str, check, timeout: float, log: Path, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
            raise AssertionError(f"{what}: not within {timeout:.0f} s\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def site(tmp_path_factory, tiny_model_dir):
    """{hosts, pg, env, mlflow, root, model}: the database host "db" running PostgreSQL, S3 and the MLflow server,
    and hosts a and b, each with a private cache."""
    root = tmp_path_factory.mktemp("shared-db")
    with Cluster(["db", "a", "b"]) as hosts, Postgres(root, host=hosts["db"]) as pg:
        db = hosts["db"]
        env = clean_env(TMPDIR=str(root))
        s3 = f"http://{db.name}:9000"
        db_env = {**env, **CREDENTIALS, "AWS_ENDPOINT_URL": s3, "MLFLOW_S3_ENDPOINT_URL": s3}
        db.popen([sys.executable, "-m", "moto.server", "-H", "0.0.0.0", "-p", "9000"], log=root / "s3.log", env=db_env)
        wait_until("the S3 server", lambda: db.run([sys.executable, "-c", MAKE_BUCKET, s3, BUCKET], env=db_env,
                                                   timeout=60).returncode == 0, 60, root / "s3.log")
        mlflow = f"http://{db.name}:5000"
        server = db.popen([str(Path(sys.executable).with_name("mlflow")), "server", "--host", "0.0.0.0",
                           "--port", "5000", "--workers", "1",
                           "--backend-store-uri", pg.url("mlflow", driver="psycopg"),
                           "--artifacts-destination", f"s3://{BUCKET}/mlflow",
                           "--allowed-hosts", f"{db.name}:5000,{db.name}"], log=root / "mlflow.log", env=db_env)
        probe = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/health', timeout=5)"
        wait_until("the MLflow server", lambda: hosts["a"].run([sys.executable, "-c", probe, mlflow], env=env,
                                                               timeout=30).returncode == 0, 180, root / "mlflow.log",
                   server)
        for name in ("a", "b"):
            (root / f"cache-{name}").mkdir()
            (root / f"study-{name}").mkdir()
            other = "b" if name == "a" else "a"
            hosts[name].hidden += [str(root / f"cache-{other}"), str(root / f"study-{other}")]
        yield {"hosts": hosts, "pg": pg, "env": env, "mlflow": mlflow, "root": root, "model": tiny_model_dir}


def study_args(site, name: str) -> list[str]:
    root = site["root"]
    (root / "unused.csv").write_text("text,label\n")
    return ["--data.path", str(root / "unused.csv"), "--model.path", site["model"],
            "--output.dir", str(root / f"study-{name}" / "study"), "--train.precision", "fp32",
            "--train.batch_size", "8", "--train.epochs", "1", "--engine.workers", "1",
            "--engine.threads_per_worker", "1", "--eval.baseline", "false", "--tune.backend", "optuna",
            "--tune.trials", str(TRIALS), "--tune.storage", site["pg"].url("optuna"), "--tune.space", SPACE,
            "--tracking.uri", site["mlflow"]]


@pytest.fixture(scope="module")
def study(site):
    """Both hosts' `torchloom tune` on one study, started together; {name: (exit code, output)} and the database's
    and the MLflow server's view of it afterwards."""
    hosts, root = site["hosts"], site["root"]
    procs, logs = {}, {}
    for name in ("a", "b"):
        args = study_args(site, name)
        prepared_study(root / f"study-{name}" / "study", args)
        logs[name] = root / f"tune-{name}.log"
        procs[name] = hosts[name].popen([sys.executable, "-m", "torchloom", "tune", *args], log=logs[name],
                                        env={**site["env"], "TORCHLOOM_CACHE": str(root / f"cache-{name}")})
    for proc in procs.values():
        proc.wait(timeout=600)
    said = {name: (procs[name].returncode, logs[name].read_text(errors="replace")) for name in procs}
    seen = hosts["db"].run([sys.executable, "-c", INSPECT, site["pg"].url("optuna", driver="psycopg"),
                            site["mlflow"], "study"], env=site["env"], timeout=120)
    assert seen.returncode == 0, seen.stderr[-3000:]
    return said, json.loads(seen.stdout)


def test_two_hosts_fill_one_study_in_postgresql_and_log_every_trial_to_the_mlflow_server(site, study):
    said, seen = study
    for name, (code, text) in said.items():
        assert code == 0, f"host {name}:\n{text[-4000:]}"
        assert site["pg"].password not in text
    hosts = {name: site["hosts"][name].name for name in ("a", "b")}
    trials = [t for t in seen["trials"] if not t["attrs"].get("surplus")]
    assert len(trials) == TRIALS and {t["state"] for t in trials} <= {"COMPLETE", "PRUNED"}, seen["trials"]
    assert len({json.dumps(t["params"], sort_keys=True) for t in trials}) == TRIALS  # each configuration once
    assert {t["attrs"]["host"] for t in trials} == set(hosts.values())  # both hosts ran trials
    for name, (_, text) in said.items():  # each host ran its own trials in its own study directory
        mine = [t for t in trials if t["attrs"]["host"] == hosts[name]]
        assert text.count("started: lr=") == len(mine)
        assert all(t["attrs"]["run_dir"].startswith(str(site["root"] / f"study-{name}")) for t in mine)
        assert f"torchloom tune finished: {TRIALS} trials" in text  # the report counts the other host's too
    # on the MLflow server: one study run per host, each trial a run nested under its host's study run
    studies = {r["id"] for r in seen["runs"] if r["kind"] == "tune"}
    nested = [r for r in seen["runs"] if r["parent"] in studies]
    assert len(studies) == 2 and len(nested) == TRIALS, seen["runs"]
    assert all("val_loss" in r["metrics"] for r in nested)


def test_a_model_registered_on_one_host_is_served_by_name_on_another_with_an_empty_cache(site, study):
    said, seen = study
    hosts, root, env = site["hosts"], site["root"], site["env"]
    a, b = hosts["a"], hosts["b"]
    best = json.loads((root / "study-a" / "study" / "study.json").read_text())["best_trial"]
    trial = root / "study-a" / "study" / "trials" / best
    done = torchloom(a, ["export", "--output.dir", str(trial), "--register", "topics", "--alias", "champion",
                         "--tracking.uri", site["mlflow"]], {**env, "TORCHLOOM_CACHE": str(root / "cache-a")}, 300,
                     root / "register.log")
    assert "registered as version 1 of topics, alias champion" in done.stderr, done.stderr[-3000:]
    serve_log = root / "serve-b.log"
    b.popen([sys.executable, "-m", "torchloom", "serve", "models:/topics@champion", "--tracking-uri", site["mlflow"],
             "--port", "8000"], log=serve_log, env={**env, "TORCHLOOM_CACHE": str(root / "cache-b")})
    ask = ("import sys, time, urllib.request\n"
           "for _ in range(240):\n"
           "    try:\n"
           "        answer = urllib.request.urlopen('http://127.0.0.1:8000/v1/labels', timeout=5)\n"
           "        print(answer.read().decode()); break\n"
           "    except Exception:\n"
           "        time.sleep(0.5)\n"
           "else:\n"
           "    sys.exit(1)\n")
    answer = b.run([sys.executable, "-c", ask], env=env, timeout=180)
    text = serve_log.read_text(errors="replace")
    assert answer.returncode == 0, text[-3000:]
    assert sorted(json.loads(answer.stdout)["labels"]) == sorted(
        json.loads((trial / "model" / "config.json").read_text())["id2label"].values())
    assert "models:/topics@champion: version 1 of topics" in text
    assert any((root / "cache-b" / "registry").rglob("config.json"))  # fetched into b's own cache


def test_a_trial_whose_host_died_is_failed_and_run_again_by_a_host_still_alive(site):
    # a starts the study's first trial and dies (every process of the host killed); b, started after, runs the other
    # one; a's trial, silent for 4 heartbeats (2 s each here), is failed by b (when b starts a trial, or while b waits
    # for the trials running elsewhere: which one depends on how long b's trial takes) and run again there with the
    # same parameters: the study ends with 2 finished trials, both on b, and a's failed one
    hosts, root, env = site["hosts"], site["root"], site["env"]
    a, b = hosts["a"], hosts["b"]
    storage = site["pg"].url("lost")
    logs = {name: root / f"lost-{name}.log" for name in ("a", "b")}
    procs = {}
    for name in ("a", "b"):
        args = [*study_args(site, name), "--tune.trials", "2", "--tune.storage", storage, "--tune.heartbeat_s", "2",
                "--tracking.enabled", "false"]
        args[args.index("--output.dir") + 1] = str(root / f"study-{name}" / "lost")
        prepared_study(root / f"study-{name}" / "lost", args)
        if name == "b":
            a.kill_all()
        procs[name] = hosts[name].popen([sys.executable, "-m", "torchloom", "tune", *args], log=logs[name],
                                        env={**env, "TORCHLOOM_CACHE": str(root / f"cache-{name}")})
        if name == "a":
            wait_until("a's first trial", lambda: "started: lr=" in logs["a"].read_text(errors="replace"), 120,
                       logs["a"], procs["a"])
    procs["b"].wait(timeout=300)
    text = logs["b"].read_text(errors="replace")
    assert procs["b"].returncode == 0, text[-4000:]
    assert f"failed on {a.name}" in text  # b's report shows a's lost trial
    seen = hosts["db"].run([sys.executable, "-c", INSPECT, site["pg"].url("lost", driver="psycopg"), site["mlflow"],
                            "lost"], env=env, timeout=120)
    assert seen.returncode == 0, seen.stderr[-3000:]
    trials = json.loads(seen.stdout)["trials"]
    lost = [t for t in trials if t["attrs"].get("host") == a.name]
    finished = [t for t in trials if t["state"] in ("COMPLETE", "PRUNED")]
    assert len(lost) == 1 and lost[0]["state"] == "FAIL", trials
    assert len(finished) == 2 and {t["attrs"]["host"] for t in finished} == {b.name}, trials
    assert lost[0]["params"] in [t["params"] for t in finished]  # run again with the same parameters
