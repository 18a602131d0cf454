"""The baseline stage: the classical baseline fitted on the train split and scored on the others
(baseline/__init__.py) into baseline.json, and the stored one when it is still this run's."""

from __future__ import annotations

import shutil

from torchloom.config import Config
from torchloom.console import say
from torchloom.errors import UserError
from torchloom.etl.session import stop_spark
from torchloom.jsonio import read_json, write_json
from torchloom.runs.ledger import deletable
from torchloom.runs.run import Run
from torchloom.stages import recorded


def baseline_splits(cfg: Config) -> list[str]:
    return list(dict.fromkeys(["val", "test", cfg.eval.split]))


@recorded
def baseline_stage(run: Run) -> dict | None:
    """Fit the classical baseline on the train split, C chosen on val, and score the others (baseline/__init__.py)
    into baseline.json; None when eval.baseline is off. The driver path (scikit-learn) needs no Spark; the
    Spark path uses `spark`, or starts a session and stops it."""
    cfg, rd, files, tracker, spark = run.cfg, run.rd, run.files, run.tracker, run.spark
    if not cfg.eval.baseline:
        return None
    from torchloom import baseline
    from torchloom import manifest as manifest_mod

    files.ensure(rd.data)
    deletable(files.place.tree(), "output.dir", cfg.inputs(), under="baseline")  # its arrays are replaced below
    m = manifest_mod.read(rd.data)
    how, started = "the baseline", False
    try:
        engine = baseline.engine_for(m, cfg.eval.baseline_engine)
        how = baseline.ENGINE_NAMES[engine]
        if engine == "spark" and not run.spark_here:
            m = files.streamed(m)  # a cluster's executors read the shards from the store, not our copy
        say(f"baseline: {baseline.name_of(m)} ({how}) on the train split's {baseline.train_texts(m)} texts")
        if spark is None and engine == "spark":
            from torchloom.etl.session import get_spark

            spark, started = get_spark(cfg.prepare), True
        result = baseline.fit_and_score(spark, m, baseline_splits(cfg), engine)
    except UserError:
        raise
    except Exception as e:  # the transformer's results do not depend on it: say why, and go on without it
        from torchloom.errors import first_line, one_line

        say(f"baseline: skipped, {how} failed ({one_line(first_line(e), 160)});"
            " --eval.baseline false turns it off")
        return None
    finally:
        if started:
            stop_spark()
    lexical = result.pop("lexical", None)
    shutil.rmtree(rd.baseline_model, ignore_errors=True)  # an earlier fit's arrays never go with this one's scores
    if lexical is not None:  # the arrays the shipped mix scores with (export copies them into the model)
        lexical.save(rd.baseline_model)
        result["model"] = rd.baseline_model.name
    write_json(rd.baseline, result)
    files.push(rd.baseline, rd.baseline_model)
    say(f"baseline: {baseline.summary_line(result)}")
    if tracker is not None:
        tracker.log_metrics({f"baseline_{k}_{metric}": v[metric] for k, v in result["splits"].items()
                             for metric in ("accuracy", "macro_f1", "micro_f1") if metric in v})
    return result


def stored_baseline(run: Run, m) -> dict | None:
    """baseline.json, when it was made from these prepared rows and scored the evaluated split."""
    cfg, rd = run.cfg, run.rd
    run.files.ensure(rd.baseline)
    if not rd.baseline.is_file():
        return None
    try:
        stored = read_json(rd.baseline)
    except (OSError, ValueError):
        return None
    if stored.get("fingerprint") != m.fingerprint or cfg.eval.split not in stored.get("splits", {}):
        return None
    return stored
