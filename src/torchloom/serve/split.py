"""A traffic split between models (serve/fleet.py): the plan of who answers and who watches, as `--traffic`
and `--shadow` give it and the admin route changes it; and where a routing key falls. Standard library only:
`torchloom serve`'s settings and `torchloom k8s serve` check a split with it before anything loads."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field


@dataclass
class Plan:
    """Who answers and who watches: the split in percent (summing to 100) and the shadows."""

    traffic: dict[str, float]
    shadows: list[str] = field(default_factory=list)

    def line(self) -> str:
        split = ",".join(f"{k}={v:g}" for k, v in self.traffic.items() if v)
        return f"traffic {split}" + (f", shadow {','.join(self.shadows)}" if self.shadows else "")


def parse_traffic(given: str | dict[str, float], names: list[str], what: str = "--traffic") -> dict[str, float]:
    """`A=90,B=10` (or a dict from JSON) as {name: percent}, every model named, summing to 100; one line naming
    what is wrong otherwise (a UserError at start, a 422 from the admin route)."""
    from torchloom.errors import UserError

    example = f"e.g. {what} {'=90,'.join(names[:2])}=10" if len(names) > 1 else f"e.g. {what} {names[0]}=100"
    if isinstance(given, str):
        parts = {}
        for part in filter(None, (p.strip() for p in given.split(","))):
            name, sep, share = part.partition("=")
            if not sep:
                raise UserError(f"{what} {given}: {part!r} is not NAME=PERCENT; {example}")
            parts[name.strip()] = share.strip()
        given = parts
    traffic = {}
    for name, share in given.items():
        if name not in names:
            raise UserError(f"{what}: no model is named {name!r} (the models: {', '.join(names)})")
        try:
            traffic[name] = float(share)
        except (TypeError, ValueError):
            raise UserError(f"{what}: {name}={share} is not a number of percent; {example}") from None
        if not 0 <= traffic[name] <= 100 or math.isnan(traffic[name]):
            raise UserError(f"{what}: {name}={share} is not between 0 and 100 percent; {example}")
    total = sum(traffic.values())
    if abs(total - 100) > 1e-6:
        raise UserError(f"{what}: the shares add up to {total:g}, not 100; {example}")
    return {name: traffic.get(name, 0.0) for name in names}


def make_plan(names: list[str], traffic: str | dict | None, shadows: list[str], what: str = "--traffic") -> Plan:
    """The plan for these models: `traffic` checked (None: an even split over the models that are not shadows),
    every shadow a model without traffic."""
    from torchloom.errors import UserError

    for s in shadows:
        if s not in names:
            raise UserError(f"--shadow {s}: no model is named {s!r} (the models: {', '.join(names)})")
    answering = [n for n in names if n not in shadows]
    if not answering:
        raise UserError(f"--shadow {','.join(shadows)}: every model is a shadow; one must answer")
    if traffic is None:
        split = {n: (100 / len(answering) if n in answering else 0.0) for n in names}
    else:
        split = parse_traffic(traffic, names, what)
    for s in shadows:
        if split.get(s):
            raise UserError(f"--shadow {s}: a shadow's answers are never returned; give it no traffic ({what})")
    return Plan(split, list(dict.fromkeys(shadows)))


def key_point(key: str) -> float:
    """Where a routing key falls in [0, 100): the same key, the same point, on every server and every start."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2 ** 64 * 100
