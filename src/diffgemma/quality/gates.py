"""Acceptance gates: rules over the per-arm statistics (analyze.py) that decide a campaign, and its exit code.

A gate is a JSON object:
    {"arm": "B", "metric": "exact_match", "min_delta": -0.01}       # B within 1 point of the baseline
    {"arm": "B", "metric": "forwards", "max_ratio": 0.8}            # B needs at most 0.8x the baseline's forwards
    {"arm": "A", "metric": "exact_match", "min": 0.85, "battery": "smoke"}
Bounds: min / max (absolute), min_delta / max_delta (arm - reference), min_ratio / max_ratio (arm / reference);
the reference is "vs" (an arm), default the campaign's baseline; "battery" defaults to all batteries together.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError
from .analyze import ALL, METRICS

BOUNDS = ("min", "max", "min_delta", "max_delta", "min_ratio", "max_ratio")
EXIT_PASS, EXIT_GATE_FAILED = 0, 1


@dataclass
class GateResult:
    text: str  # the rule, readable
    ok: bool
    detail: str  # the numbers it was decided on


def parse_gate(g, campaign, origin: str) -> dict:
    """Validate a gate against a campaign (its arms) before anything runs; returns it."""
    if not isinstance(g, dict):
        raise InputError(f"{origin}: expected an object like {{\"arm\": ..., \"metric\": ..., \"min\": ...}}")
    unknown = set(g) - {"arm", "metric", "vs", "battery", *BOUNDS}
    if unknown:
        raise InputError(f"{origin}: unknown key(s) {sorted(unknown)}; expected arm, metric, vs, battery and "
                         f"bounds among {', '.join(BOUNDS)}")
    if g.get("metric") not in METRICS:
        raise InputError(f"{origin}: metric {g.get('metric')!r}: expected one of {', '.join(METRICS)}")
    campaign.arm(g.get("arm", ""))
    if "vs" in g:
        campaign.arm(g["vs"])
    bounds = [b for b in BOUNDS if b in g]
    if not bounds:
        raise InputError(f"{origin}: no bound; give at least one of {', '.join(BOUNDS)}")
    for b in bounds:
        if isinstance(g[b], bool) or not isinstance(g[b], (int, float)):
            raise InputError(f"{origin}: {b} {g[b]!r}: expected a number")
    return g


def _describe(g: dict, ref: str) -> str:
    m, scope = g["metric"], "" if g.get("battery", ALL) == ALL else f" [{g['battery']}]"
    parts = []
    for b in BOUNDS:
        if b in g:
            op = ">=" if b.startswith("min") else "<="
            lhs = {"": f"{g['arm']}.{m}", "_delta": f"{g['arm']}.{m} - {ref}.{m}",
                   "_ratio": f"{g['arm']}.{m} / {ref}.{m}"}[b[3:]]
            parts.append(f"{lhs} {op} {g[b]:g}")
    return " and ".join(parts) + scope


def evaluate(gates: list[dict], summary: dict, baseline: str) -> list[GateResult]:
    out = []
    for g in gates:
        ref = g.get("vs", baseline)
        battery = g.get("battery", ALL)
        text = _describe(g, ref)

        def value(arm):
            return summary.get(arm, {}).get(battery, {}).get(g["metric"])

        v, r = value(g["arm"]), value(ref)
        ok, details = True, [f"{g['arm']}={_num(v)}"]
        needs_ref = any(k in g for k in ("min_delta", "max_delta", "min_ratio", "max_ratio"))
        if needs_ref:
            details.append(f"{ref}={_num(r)}")
        if v is None or (needs_ref and r is None):
            out.append(GateResult(text, False, ", ".join(details) + " (no data)"))
            continue
        for b in BOUNDS:
            if b not in g:
                continue
            if b.endswith("_delta"):
                x = v - r
            elif b.endswith("_ratio"):
                x = v / r if r else float("inf") if v > 0 else 1.0
            else:
                x = v
            # a small tolerance so that "within 1 point" holds when the difference is exactly 1 point
            ok &= x >= g[b] - 1e-9 if b.startswith("min") else x <= g[b] + 1e-9
        out.append(GateResult(text, ok, ", ".join(details)))
    return out


def _num(v) -> str:
    return "-" if v is None else f"{v:.4g}"


def report(results: list[GateResult]) -> str:
    return "\n".join(f"gate {'PASS' if r.ok else 'FAIL'}: {r.text}  ({r.detail})" for r in results)


def exit_code(results: list[GateResult]) -> int:
    return EXIT_PASS if all(r.ok for r in results) else EXIT_GATE_FAILED
