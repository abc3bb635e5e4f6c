"""Campaign files: the settings arms of a census and its acceptance gates.

An arms file is JSON, either a mapping of arm name -> overrides, or an object with "arms" (that mapping), and
optionally "baseline" (the arm gates compare against; default the first arm) and "gates" (gates.py). Overrides
are a mapping of setting -> value or a list of "name=value" strings, exactly what `--set` takes. Every arm is
validated here, through the same parsing as `--set`, so a typo'd arm dies before any model loads.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InputError, SettingsError
from ..settings import GenerationSettings
from ..settings import parse_overrides as parse_set_items  # the parser --set uses

_ARM_NAME = re.compile(r"^[A-Za-z0-9_.+-]{1,64}$")


@dataclass(frozen=True)
class Arm:
    name: str
    overrides: dict[str, Any]  # setting -> parsed value, as GenerationSettings takes it


@dataclass
class Campaign:
    arms: list[Arm]
    baseline: str
    gates: list[dict] = field(default_factory=list)

    def arm(self, name: str) -> Arm:
        for a in self.arms:
            if a.name == name:
                return a
        raise InputError(f"arm {name!r}: not in this campaign (arms: {', '.join(a.name for a in self.arms)})")

    def to_json(self) -> dict:
        return {"arms": {a.name: a.overrides for a in self.arms}, "baseline": self.baseline, "gates": self.gates}


def parse_overrides(name: str, raw: Any) -> dict[str, Any]:
    """An arm's overrides -> {setting: value}, validated like `--set` (and against each other); SettingsError
    names the arm."""
    if isinstance(raw, dict):
        items = [f"{k}={_as_set_value(v)}" for k, v in raw.items()]
    elif isinstance(raw, list) and all(isinstance(x, str) for x in raw):
        items = list(raw)
    else:
        raise InputError(f"arm {name!r}: expected an object of settings or a list of \"name=value\" strings, "
                         f"got {type(raw).__name__}")
    try:
        GenerationSettings.resolve({}, env={}, overrides=items)  # names, values and ranges, as --set
        return parse_set_items(items)
    except SettingsError as e:
        raise SettingsError(f"arm {name!r}: {e}") from None


def _as_set_value(value: Any) -> str:
    """A JSON value as `--set` would spell it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return ",".join(str(v) for v in value) if value else "none"
        return json.dumps(list(value)) if value else ""
    return str(value)


def parse_campaign(data: Any, origin: str = "arms") -> Campaign:
    if not isinstance(data, dict) or not data:
        raise InputError(f"{origin}: expected a JSON object of arms (name -> settings)")
    if "arms" in data:
        unknown = set(data) - {"arms", "baseline", "gates", "description"}
        if unknown:
            raise InputError(f"{origin}: unknown key(s) {sorted(unknown)}; expected arms, baseline, gates, description")
        arms_raw = data["arms"]
        if not isinstance(arms_raw, dict) or not arms_raw:
            raise InputError(f"{origin}: \"arms\" must be a non-empty object of arm name -> settings")
    else:
        arms_raw, data = data, {}
    arms = []
    for name, raw in arms_raw.items():
        if not _ARM_NAME.match(name):
            raise InputError(f"{origin}: arm name {name!r}: use letters, digits and _ . + - (at most 64)")
        arms.append(Arm(name, parse_overrides(name, raw)))
    baseline = data.get("baseline", arms[0].name)
    campaign = Campaign(arms, baseline, list(data.get("gates") or []))
    campaign.arm(baseline)
    from .gates import parse_gate  # gates are validated before the model loads too

    for i, g in enumerate(campaign.gates):
        parse_gate(g, campaign, f"{origin}: gates[{i}]")
    return campaign


def read_json(path: Path, flag: str) -> Any:
    """The JSON a command-line file flag names, or a one-line InputError naming the flag and the file."""
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise InputError(f"{flag} {path}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{flag} {path}: not valid JSON ({e})") from None


def load_campaign(path: str | Path) -> Campaign:
    path = Path(path)
    return parse_campaign(read_json(path, "--arms"), f"--arms {path}")
