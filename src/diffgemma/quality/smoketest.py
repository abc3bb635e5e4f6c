"""The smoketest gate: a fixed campaign (battery, arms, seeds, thresholds) a change must pass.

The spec is JSON: {"battery": NAME[,NAME], "arms": {...}, "baseline", "gates": [...], "seeds": [7],
"aggregate_seeds": [7, 42, 123]} — arms and gates as in an arms file (arms.py, gates.py). The shipped spec
(assets/batteries/smoketest.gate.json) gates the embedded demo model on its smoke battery; the multi-seed
aggregate judges changes that reshuffle trajectories, where one seed's flips are noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from .arms import Campaign, parse_campaign, read_json
from .batteries import SHIPPED, Battery, load_battery

DEFAULT_SPEC = SHIPPED / "smoketest.gate.json"


@dataclass
class Spec:
    campaign: Campaign
    batteries: list[Battery]
    seeds: list[int]
    aggregate_seeds: list[int]


def load_spec(path: str | Path | None = None) -> Spec:
    path = Path(path) if path else DEFAULT_SPEC
    data = read_json(path, "--spec")
    origin = f"smoketest spec {path}"
    if not isinstance(data, dict):
        raise InputError(f"{origin}: expected a JSON object")
    unknown = set(data) - {"battery", "arms", "baseline", "gates", "seeds", "aggregate_seeds", "description"}
    if unknown:
        raise InputError(f"{origin}: unknown key(s) {sorted(unknown)}")
    if not isinstance(data.get("battery"), str):
        raise InputError(f"{origin}: \"battery\" must name the battery (or batteries, comma-separated)")
    campaign = parse_campaign({k: data[k] for k in ("arms", "baseline", "gates", "description") if k in data}, origin)
    if not campaign.gates:
        raise InputError(f"{origin}: a smoketest needs at least one gate")
    seeds = _seeds(data.get("seeds", [0]), origin, "seeds")
    aggregate = _seeds(data.get("aggregate_seeds", seeds), origin, "aggregate_seeds")
    batteries = [load_battery(n.strip()) for n in data["battery"].split(",") if n.strip()]
    return Spec(campaign, batteries, seeds, aggregate)


def _seeds(value, origin: str, key: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(s, int) and not isinstance(s, bool)
                                                             and s >= 0 for s in value):
        raise InputError(f"{origin}: {key}: expected a non-empty list of non-negative integers")
    return list(value)
