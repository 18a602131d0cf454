"""Build a Config from defaults, a TOML file and `--section.key value` overrides, and validate it."""

from __future__ import annotations

import codecs
import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from torchloom.config.budget import known_batch
from torchloom.config.engines import engine_of, ranks_on_this_machine
from torchloom.config.schema import Config, TrainConfig
from torchloom.errors import UserError
from torchloom.redaction import redact_config, remember


def sections(cfg: Config) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def _field(section_obj: Any, key: str, where: str) -> dataclasses.Field:
    fields = {f.name: f for f in dataclasses.fields(section_obj)}
    if key not in fields:
        raise UserError(f"{where}: unknown key; known keys: {', '.join(sorted(fields))}")
    return fields[key]


def _coerce(value: Any, f: dataclasses.Field, where: str) -> Any:
    """Turn a TOML value or a command-line string into the field's type."""
    kind = f.metadata.get("type") or (type(f.default) if f.default is not dataclasses.MISSING else dict)
    from_cli = isinstance(value, str) and kind is not str
    if f.metadata.get("auto") and isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"  # a number, or "auto": the stage picks one from the data
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            if from_cli and value.lower() in ("true", "1", "yes", "on"):
                return True
            if from_cli and value.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if kind in (int, float):
            # A TOML int is a fine float; a float is never an int, and a bool is neither.
            if isinstance(value, bool) or not (from_cli or isinstance(value, (int, kind))):
                raise ValueError
            return kind(value)
        if kind is dict:
            if from_cli:
                loaded = tomllib.loads(f"x = {value}")["x"]
                if not isinstance(loaded, dict):
                    raise ValueError
                return loaded
            if isinstance(value, dict):
                return value
            raise ValueError
        if not isinstance(value, str):
            raise ValueError
        return value
    except (ValueError, tomllib.TOMLDecodeError):
        shown = {bool: "true or false", int: "an integer", float: "a number", dict: "a table like {a = \"b\"}"}
        what = shown.get(kind, "a string") + (' or "auto"' if f.metadata.get("auto") else "")
        raise UserError(f"{where}: {value!r} is not {what}") from None


def apply(cfg: Config, section: str, key: str, value: Any, origin: str) -> None:
    parts = sections(cfg)
    where = f"--{section}.{key}" if origin == "cli" else f"{origin} {section}.{key}"
    if section not in parts:
        place = f"--{section}.{key}" if origin == "cli" else f"{origin} [{section}]"
        raise UserError(f"{place}: unknown section {section!r}; known sections: {', '.join(parts)}")
    obj = parts[section]
    f = _field(obj, key, where)
    setattr(obj, key, _coerce(value, f, where))


def validate(cfg: Config) -> Config:
    for section, obj in sections(cfg).items():
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            meta = f.metadata
            where = f"config {section}.{f.name}"
            if meta.get("auto") and value == "auto":
                continue
            if "choices" in meta and value not in meta["choices"]:
                raise UserError(f"{where}: {value!r} is not allowed; choose one of {', '.join(meta['choices'])}")
            if "min" in meta and value < meta["min"]:
                raise UserError(f"{where}: {value!r} is too small; it must be >= {meta['min']}")
            if "min_exclusive" in meta and value <= meta["min_exclusive"]:
                raise UserError(f"{where}: {value!r} must be > {meta['min_exclusive']}")
            if "max" in meta and value > meta["max"]:
                raise UserError(f"{where}: {value!r} is too large; it must be <= {meta['max']}")
    _check_encoding(cfg.data.encoding)
    from torchloom.config.budget import budget_seconds

    budget_seconds(cfg.train.budget)
    if cfg.prepare.val_fraction + cfg.prepare.test_fraction >= 0.9:
        raise UserError("config prepare.val_fraction + prepare.test_fraction must be < 0.9 to leave rows to train on")
    if cfg.data.split_column and (cfg.data.val_path or cfg.data.test_path):
        raise UserError("config data.split_column and data.val_path / data.test_path: the split comes from one or"
                        " the other; set only one")
    tags, levels = cfg.data.label_delimiter, cfg.data.label_path_delimiter
    if tags and levels and (tags in levels or levels in tags):
        raise UserError(f"config data.label_delimiter {tags!r} and data.label_path_delimiter {levels!r}: one holds the"
                        " other, so a path's levels would be read as separate tags; give them different characters"
                        " (e.g. label_delimiter \"|\" and label_path_delimiter \"/\")")
    if cfg.prepare.max_chars and cfg.prepare.max_chars < cfg.prepare.min_chars:
        raise UserError("config prepare.max_chars must be 0 (no limit) or >= prepare.min_chars")
    if cfg.train.precision == "fp16" and cfg.engine.device == "cpu":
        raise UserError("config train.precision: fp16 needs a GPU; use bf16 or fp32 with engine.device = cpu")
    _check_registry(cfg.export.register, cfg.export.alias)
    from torchloom.notify import check_url

    problem = check_url(cfg.tracking.notify_url)
    if problem:
        raise UserError(f"config tracking.notify_url: {problem}")
    validate_strategy(cfg)
    if cfg.train.batch_size == "auto":
        return cfg  # it is chosen from the data, a multiple of workers x grad_accum (config/budget.py)
    if cfg.engine.workers == "auto":
        if cfg.train.strategy == "pipeline":
            micro_batch_size(cfg.train, 1)  # one pipeline's batch: the same on any number of workers
        return cfg  # the world-size checks run once resolve_workers has counted this machine
    micro_batch_size(cfg.train, cfg.engine.workers)
    low = cfg.engine.min_workers
    if low:
        if not engine_of(cfg.engine).shrinks:
            raise UserError(f"config engine.min_workers {low}: only the Ray engine shrinks a run by itself; with"
                            f" {cfg.engine.name}, resume with --train.resume latest --engine.workers N")
        if low > cfg.engine.workers:
            raise UserError(f"config engine.min_workers {low}: must be <= engine.workers {cfg.engine.workers}")
        if cfg.train.strategy == "pipeline":
            raise UserError("config engine.min_workers: a pipeline needs all its stages; leave it 0 with"
                            " train.strategy pipeline")
        micro_batch_size(cfg.train, low)  # the smallest size must divide the batch too
    return cfg


def _check_encoding(encoding: str) -> None:
    """data.encoding: auto, strict or a text codec Python knows (not base64 or rot13, which map bytes to bytes)."""
    if encoding in ("auto", "strict"):
        return
    try:
        text = getattr(codecs.lookup(encoding), "_is_text_encoding", True)
    except LookupError:
        text = None
    if not text:
        what = "no such encoding" if text is None else "not a text encoding"
        raise UserError(f"config data.encoding: {encoding!r} is {what}; use auto, strict or a Python codec name"
                        " such as utf-8, cp1252, latin-1 or utf-16")


# engine.workers auto without GPUs: 2 processes of one thread each trained 1.04x as fast as 1 process with both
# threads on a 2-core machine, and a 2-thread process stalls when one core is taken (docs/benchmarks.md,
# "Precision and workers on an AVX2-only CPU", benchmarks/workers.py).
CPU_WORKERS = 2


def resolve_workers(cfg: Config, gpus: int) -> Config:
    """engine.workers auto made a number for this machine, then the checks that need it: one per visible GPU
    (where the ranks run here, ranks_here, on a GPU machine; the largest that divides the global batch), else
    CPU_WORKERS. More GPU workers than GPUs here is refused, before prepare starts."""
    e = cfg.engine
    on_gpus = ranks_here(cfg) and e.device != "cpu" and gpus > 0
    if e.device == "cuda" and ranks_here(cfg) and gpus == 0:
        raise UserError("engine.device cuda: torch sees no CUDA device on this machine; use engine.device cpu or"
                        " auto")
    if e.workers == "auto":
        # batch_size auto is 16 times a power of two, rounded up to the workers: divisors of 16 divide it
        per_step = known_batch(cfg.train) // cfg.train.grad_accum
        e.workers = largest_divisor(per_step, gpus) if on_gpus else CPU_WORKERS
        if cfg.train.strategy == "pipeline":  # one stage per worker
            e.workers = cfg.train.pipeline_stages or max(2, e.workers)
    elif on_gpus and e.workers > gpus:
        raise UserError(f"engine.workers {e.workers}: this machine has {gpus} visible GPU{'s' if gpus != 1 else ''}"
                        f" and each worker takes one; set --engine.workers {gpus} (or leave it auto) or"
                        " --engine.device cpu")
    return validate(cfg)


def ranks_here(cfg: Config) -> bool:
    """The training ranks run on this machine and see its GPUs: the local engine, or Ray on an instance torchloom
    starts here (no engine.ray_address). Spark's ranks get GPUs only through its resource confs (engines/spark.py),
    and a cluster's are counted by the engine when it launches."""
    return ranks_on_this_machine(cfg.engine)


def largest_divisor(n: int, most: int) -> int:
    return max(d for d in range(1, max(1, min(n, most)) + 1) if n % d == 0)


def batch_multiple(train_cfg: TrainConfig, world_size: int) -> int:
    """What the global batch must be a multiple of: workers x grad_accum (with `pipeline`, grad_accum x
    microbatches: the stages share one batch)."""
    if train_cfg.strategy == "pipeline":
        return train_cfg.grad_accum * train_cfg.microbatches
    return world_size * train_cfg.grad_accum


def micro_batch_size(train_cfg: TrainConfig, world_size: int) -> int:
    """Rows per micro-step on one data-parallel rank; a batch that does not divide is a config error.

    The trainer asks again with the world size the engine really started (torchrun on several nodes).
    """
    if train_cfg.strategy == "pipeline":
        per_step = train_cfg.grad_accum * train_cfg.microbatches  # one replica; each micro-step cut into micro-batches
        if train_cfg.batch_size % per_step:
            raise UserError(
                f"config train.batch_size {train_cfg.batch_size}: with train.strategy pipeline it must be a multiple of"
                f" train.grad_accum x train.microbatches = {per_step}; choose e.g."
                f" {per_step * max(1, train_cfg.batch_size // per_step)}"
            )
        return train_cfg.batch_size // train_cfg.grad_accum
    per_step = world_size * train_cfg.grad_accum
    if train_cfg.batch_size % per_step:
        raise UserError(
            f"config train.batch_size {train_cfg.batch_size}: must be a multiple of engine.workers x"
            f" train.grad_accum = {per_step}; choose e.g. {per_step * max(1, train_cfg.batch_size // per_step)}"
        )
    return train_cfg.batch_size // per_step


def valid_world_sizes(cfg: Config) -> list[int]:
    """The worker counts a run may go on with, largest first: engine.workers down to engine.min_workers (0:
    engine.workers only), those that divide the global batch into whole micro-steps, so the global batches
    stay the same (data/loader.py)."""
    train_cfg, e = cfg.train, cfg.engine
    batch = known_batch(train_cfg)
    per_step = batch // train_cfg.grad_accum if batch % train_cfg.grad_accum == 0 else 0
    low = e.min_workers or e.workers
    return [w for w in range(e.workers, low - 1, -1) if w == e.workers or (per_step and per_step % w == 0)]


def elastic_micro_batch(global_batch: int, world_size: int, micro_batch: int, limit: int) -> int:
    """The micro-batch for `world_size` workers when a run resumes on other workers: `micro_batch`
    (what the config gives) unless it exceeds `limit` (the micro-batch the checkpoint's workers ran,
    known to fit), then the largest that fits and divides the per-worker share of the global batch,
    the rest done by gradient accumulation."""
    if micro_batch <= limit:
        return micro_batch
    share = global_batch // world_size
    return max(b for b in range(1, limit + 1) if share % b == 0)


def _check_registry(name: str, alias: str) -> None:
    """export.register and export.alias as MLflow's registry takes them, checked before any work."""
    import re

    if alias and not name:
        raise UserError(f"config export.alias {alias!r}: an alias names a version of a registered model; give the"
                        " model's name too (--register NAME --alias ALIAS)")
    if name and (len(name) > 256 or "/" in name or ":" in name or "@" in name or name != name.strip()):
        raise UserError(f"config export.register {name!r}: not a model name the registry takes; use letters, digits,"
                        " '.', '_' or '-', without '/', ':' or '@'")
    if alias and (not re.fullmatch(r"[A-Za-z0-9_\-]{1,255}", alias) or alias.lower() == "latest"
                  or re.fullmatch(r"[vV]\d+", alias)):
        raise UserError(f"config export.alias {alias!r}: use letters, digits, '_' or '-' (not 'latest' nor v<digits>,"
                        " which MLflow reserves), e.g. champion")


def validate_strategy(cfg: Config) -> None:
    train_cfg = cfg.train
    if train_cfg.compile and train_cfg.strategy != "ddp":
        raise UserError(f"config train.compile: runs with train.strategy ddp only; set train.compile false with"
                        f" train.strategy {train_cfg.strategy}")
    if train_cfg.packing and train_cfg.strategy == "pipeline":  # its stages pass padded rows of a fixed shape
        raise UserError("config train.packing: runs with train.strategy ddp or fsdp; set train.packing false with"
                        " train.strategy pipeline")
    if train_cfg.strategy != "ddp" and train_cfg.precision == "fp16":
        raise UserError(f"config train.precision: fp16 (with a gradient scaler) runs with train.strategy ddp only;"
                        f" use bf16 with train.strategy {train_cfg.strategy}")
    if train_cfg.strategy == "pipeline":
        if cfg.engine.workers == "auto":  # resolve_workers makes it pipeline_stages (or 2 or more)
            stages = train_cfg.pipeline_stages or 2
        else:
            stages = train_cfg.pipeline_stages or cfg.engine.workers
        if cfg.engine.workers != "auto" and stages != cfg.engine.workers:
            raise UserError(f"config train.pipeline_stages {stages}: must equal engine.workers {cfg.engine.workers}"
                            " (one stage per worker; pipelines side by side are not supported); set them equal")
        if stages < 2:
            raise UserError("config train.strategy pipeline: needs 2 or more stages, one per worker;"
                            " set engine.workers to 2 or more")


def load_toml(cfg: Config, path: str | Path) -> None:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config {path}: no such file; pass a TOML file (torchloom config > run.toml writes one)")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"--config {path}: not valid TOML ({e}); fix the file") from None
    for section, table in data.items():
        if not isinstance(table, dict):
            raise UserError(f"--config {path}: top-level key {section!r} must be a [section] table")
        for key, value in table.items():
            apply(cfg, section, key, value, f"--config {path}:")


# Flags spelled as serve, predict and monitor spell them, for the config key they set (one spelling everywhere).
FLAG_ALIASES = {"--tracking-uri": "--tracking.uri"}


def parse_overrides(args: list[str]) -> list[tuple[str, str, str]]:
    """`--train.lr 3e-5` or `--train.lr=3e-5` into (section, key, value); `--tracking-uri URI` is --tracking.uri's."""
    out = []
    i = 0
    while i < len(args):
        arg = args[i]
        flag, eq, rest = arg.partition("=")
        arg = FLAG_ALIASES.get(flag, flag) + eq + rest
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise UserError(f"{arg}: not an option; config overrides look like --train.lr 3e-5 (see torchloom config)")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise UserError(f"{arg}: missing a value; write {arg} VALUE")
            value = args[i + 1]
            i += 1
        section, _, key = name.partition(".")
        out.append((section, key, value))
        i += 1
    return out


def build(config_file: str | None = None, overrides: list[str] | None = None, base: Config | None = None) -> Config:
    """Defaults (or `base`), then the TOML file, then the command-line overrides; validated."""
    cfg = base if base is not None else Config()
    # a password in a URL given here is masked by value from now on, in every line and file (redaction.remember),
    # before anything can fail and say the value
    remember([*(overrides or []), *(o.split("=", 1)[-1] for o in overrides or [])])
    if config_file:
        load_toml(cfg, config_file)
        remember(to_dict(cfg))
    for section, key, value in parse_overrides(overrides or []):
        apply(cfg, section, key, value, "cli")
    cfg = validate(cfg)
    remember(to_dict(cfg))
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def from_dict(data: dict[str, Any]) -> Config:
    cfg = Config()
    for section, table in data.items():
        for key, value in table.items():
            apply(cfg, section, key, value, "saved config")
    cfg = validate(cfg)
    remember(to_dict(cfg))
    return cfg


def to_toml(cfg: Config) -> str:
    """The config as TOML with its secrets masked (redaction.py): what is written to config.toml and printed."""
    import tomli_w

    return tomli_w.dumps(redact_config(to_dict(cfg)))


def save(cfg: Config, path: str | Path) -> None:
    """Written whole (a link at the path is replaced, never written through)."""
    from torchloom.jsonio import write_atomic

    write_atomic(path, to_toml(cfg))


def load_saved(path: str | Path) -> Config:
    return from_dict(tomllib.loads(Path(path).read_text(encoding="utf-8")))
