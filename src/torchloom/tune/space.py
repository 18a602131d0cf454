"""The search space: `tune.space` maps config keys to distributions, checked before any trial runs.

    [tune.space]
    "train.lr" = "loguniform(1e-5, 1e-3)"
    batch_size = "choice(16, 32)"          # a bare key is looked up in train, then model, eval, prepare
    "train.warmup_ratio" = "uniform(0, 0.2)"
    "train.grad_accum" = "int(1, 4)"       # integers, both ends included; logint(a, b) on a log scale
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from torchloom.config import Config
from torchloom.config.load import _coerce, _field, sections, validate
from torchloom.errors import UserError

KINDS = ("uniform", "loguniform", "int", "logint", "choice")
BARE_KEY_ORDER = ("train", "model", "eval", "prepare", "engine")
NOT_TUNABLE = {"output", "tune", "tracking", "data"}


@dataclass(frozen=True)
class Param:
    key: str  # "section.field"
    kind: str
    args: tuple

    @property
    def low(self):
        return self.args[0]

    @property
    def high(self):
        return self.args[1]

    @property
    def log(self) -> bool:
        return self.kind in ("loguniform", "logint")

    def describe(self) -> str:
        return f"{self.kind}({', '.join(repr(a) if isinstance(a, str) else str(a) for a in self.args)})"

    def suggest(self, trial) -> Any:
        """An Optuna trial's value for this parameter."""
        if self.kind == "choice":
            return trial.suggest_categorical(self.key, list(self.args))
        if self.kind in ("int", "logint"):
            return trial.suggest_int(self.key, self.low, self.high, log=self.log)
        return trial.suggest_float(self.key, self.low, self.high, log=self.log)

    def ray_domain(self):
        from ray import tune

        if self.kind == "choice":
            return tune.choice(list(self.args))
        if self.kind == "int":
            return tune.randint(self.low, self.high + 1)  # Ray's upper bound is exclusive
        if self.kind == "logint":
            return tune.lograndint(self.low, self.high + 1)
        if self.kind == "loguniform":
            return tune.loguniform(self.low, self.high)
        return tune.uniform(self.low, self.high)


def resolve_key(cfg: Config, key: str) -> str:
    parts = sections(cfg)
    if "." in key:
        section, _, name = key.partition(".")
        if section not in parts:
            raise UserError(f"tune.space {key}: unknown section {section!r}; known sections: {', '.join(parts)}")
        if section in NOT_TUNABLE:
            raise UserError(f"tune.space {key}: the {section} section cannot be tuned; tune train, model or eval keys")
        _field(parts[section], name, f"tune.space {key}")
        return key
    for section in BARE_KEY_ORDER:
        if any(f.name == key for f in dataclasses.fields(parts[section])):
            return f"{section}.{key}"
    raise UserError(f"tune.space {key}: unknown config key; write it as section.key, e.g. train.lr"
                    " (torchloom config lists them)")


SPEC = re.compile(r"^\s*([a-z_]+)\s*\((.*)\)\s*$", re.S)


def parse_one(cfg: Config, key: str, spec: Any) -> Param:
    full = resolve_key(cfg, key)
    where = f"tune.space {full}"
    if not isinstance(spec, str) or not SPEC.match(spec):
        raise UserError(f"{where}: {spec!r} is not a distribution; write e.g. \"loguniform(1e-5, 1e-3)\","
                        f" one of {', '.join(k + '(...)' for k in KINDS)}")
    kind, body = SPEC.match(spec).groups()
    if kind not in KINDS:
        raise UserError(f"{where}: unknown distribution {kind!r}; use one of {', '.join(KINDS)}")
    try:
        args = ast.literal_eval(f"({body},)") if body.strip() else ()
    except (ValueError, SyntaxError):
        raise UserError(f"{where}: cannot read the arguments of {spec!r}; numbers or quoted strings,"
                        " separated by commas") from None
    if kind == "choice":
        if not args:
            raise UserError(f"{where}: choice() needs at least one value")
        return Param(full, kind, tuple(args))
    if len(args) != 2 or not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args):
        raise UserError(f"{where}: {kind} takes two numbers, low and high, e.g. {kind}(1, 8)")
    low, high = args
    if kind in ("int", "logint") and not all(float(a).is_integer() for a in args):
        raise UserError(f"{where}: {kind} takes two integers; for fractions use uniform or loguniform")
    if low >= high:
        raise UserError(f"{where}: low {low} must be below high {high}")
    if kind.startswith("log") and low <= 0:
        raise UserError(f"{where}: {kind} needs low > 0 (got {low}); use {kind[3:]} for ranges reaching 0")
    section, _, name = full.partition(".")
    if kind in ("uniform", "loguniform") and is_int_setting(_field(sections(cfg)[section], name, where)):
        raise UserError(f"{where}: an integer setting; use int({low}, {high}) or choice(...) instead of {kind}")
    if kind in ("int", "logint"):
        low, high = int(low), int(high)
    return Param(full, kind, (low, high))


def is_int_setting(f) -> bool:
    """An integer key of the config (its declared type where it also takes "auto", as train.epochs does)."""
    kind = f.metadata.get("type") or type(f.default)
    return kind is int


def parse(cfg: Config) -> list[Param]:
    """The config's search space, each parameter checked: its key, its distribution, and that the
    values at its ends (or each choice) make a valid config."""
    space = cfg.tune.space
    if not space:
        raise UserError("tune.space is empty; add at least one parameter, e.g."
                        " --tune.space '{\"train.lr\" = \"loguniform(1e-5, 1e-3)\"}'")
    params = [parse_one(cfg, key, spec) for key, spec in space.items()]
    seen: dict[str, str] = {}
    for p, key in zip(params, space):
        if p.key in seen:
            raise UserError(f"tune.space: {key} and {seen[p.key]} are the same key {p.key}; keep one")
        seen[p.key] = key
    for p in params:
        candidates = list(p.args) if p.kind == "choice" else [p.low, p.high]
        for value in candidates:
            apply(cfg, {p.key: value}, where=f"tune.space {p.key} = {p.describe()}")
    return params


def apply(cfg: Config, values: dict[str, Any], where: str = "tune") -> Config:
    """A validated copy of cfg with the sampled values set."""
    out = copy.deepcopy(cfg)
    parts = sections(out)
    for key, value in values.items():
        section, _, name = key.partition(".")
        f = _field(parts[section], name, f"{where}")
        if isinstance(value, float) and is_int_setting(f):
            if not value.is_integer():
                raise UserError(f"{where}: {key} is an integer setting; use int(a, b) or choice of integers")
            value = int(value)
        try:
            setattr(parts[section], name, _coerce(value, f, f"{where}"))
        except UserError as e:
            raise UserError(f"{e}") from None
    try:
        validate(out)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    return out  # validate() has checked the cross-field rules (batch divisibility among them)


def short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if (value and (abs(value) < 1e-2 or abs(value) >= 1e4)) else f"{value:.4g}"
    return str(value)


def is_finite_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
