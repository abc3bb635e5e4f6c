"""Which format each tensor gets: the five profiles, tensor classes and `--set class=format`.

Profiles (the base policy; everything not named stays raw = the source bytes verbatim):
    q4      experts q4 (group-32 affine), SC MLP q8 per-row
    q5      experts q5,                   SC MLP q8
    q6      experts q6,                   SC MLP q8
    nvfp4   experts, attention and dense FFN nvfp4, SC MLP q8
    nvfp4x  the legacy experts-only nvfp4 profile: expands to `--profile q4 --set experts=nvfp4`
Embeddings, router, norms and layer scalars are raw in every profile and cannot be overridden.

`--set CLASS=FORMAT` layers per-class overrides on top of the profile. Only tensors that
`tensor_class` maps to a class can be reached; locked tensors map to no class at all, so no override
reaches one by accident, and naming a locked class is an error that prints why it is locked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import SettingsError

PROFILES = ("q4", "q5", "q6", "nvfp4", "nvfp4x")

# Classes reachable by --set, their legal formats (a class only takes formats the GPU runtime has a
# kernel for) and why the other formats are refused.
_EXPERT_FORMATS = ("q4", "q6", "nvfp4")
_LINEAR_FORMATS = ("raw", "q8", "q4", "nvfp4")
_EXPERT_WHY = ("raw/q8 would silently fall back to the scalar per-expert kernel (a probe/oracle surface, never a "
               "production dispatch path); q5 experts are reachable only through --profile q5")
_LINEAR_WHY = "q6 dequant exists only in the block-sparse MoE kernel body; the dense-linear kernel has no q6 branch"
CLASS_FORMATS = {
    "experts": _EXPERT_FORMATS,
    "experts.gate_up": _EXPERT_FORMATS,
    "experts.down": _EXPERT_FORMATS,
    "attn": _LINEAR_FORMATS,
    "dense": _LINEAR_FORMATS,
    "sc": _LINEAR_FORMATS,
    "vision": ("raw", "q8", "q4", "q6", "nvfp4"),
}
CLASS_WHY_NOT = {
    "experts": _EXPERT_WHY, "experts.gate_up": _EXPERT_WHY, "experts.down": _EXPERT_WHY,
    "attn": _LINEAR_WHY, "dense": _LINEAR_WHY, "sc": _LINEAR_WHY,
    "vision": "q5 has no kernel anywhere outside the expert stacks",
}
SET_FORMATS = ("raw", "q8", "q4", "q6", "nvfp4")

_EMBED_WHY = "tied to the lm_head and the SC soft-embed; bf16 keeps tail-token logits sharp"
_ROUTER_WHY = "routing is precision-sensitive (near-boundary noise flips experts discretely) and the tensors are tiny"
_NORM_WHY = "norm and layer-scalar vectors are precision-sensitive and tiny"
LOCKED = {
    "embed": _EMBED_WHY, "embed_tokens": _EMBED_WHY,
    "router": _ROUTER_WHY,
    "norms": _NORM_WHY, "norm": _NORM_WHY, "layer_scalar": _NORM_WHY,
}

_DECODER = r"model\.decoder\."
_CLASS_PATTERNS = [
    ("experts.gate_up", re.compile(_DECODER + r"layers\.\d+\.experts\.gate_up_proj$")),
    ("experts.down", re.compile(_DECODER + r"layers\.\d+\.experts\.down_proj$")),
    ("attn", re.compile(_DECODER + r"layers\.\d+\.self_attn\.[qkvo]_proj\.weight$")),
    ("dense", re.compile(_DECODER + r"layers\.\d+\.mlp\.(gate|up|down)_proj\.weight$")),
    ("sc", re.compile(_DECODER + r"self_conditioning\.(gate|up|down)_proj\.weight$")),
    ("vision", re.compile(r"model\.encoder\.(vision_tower\..*\.linear\.weight|vision_tower\.patch_embedder\.input_proj\.weight"
                          r"|embed_vision\.embedding_projection\.weight)$")),
]

_PROFILE_BASE = {
    "q4": {"experts": "q4", "sc": "q8"},
    "q5": {"experts": "q5", "sc": "q8"},
    "q6": {"experts": "q6", "sc": "q8"},
    "nvfp4": {"experts": "nvfp4", "attn": "nvfp4", "dense": "nvfp4", "sc": "q8"},
}


def tensor_class(name: str) -> str | None:
    """The --set class of a checkpoint tensor, or None (locked or unclassed: always raw)."""
    for cls, pat in _CLASS_PATTERNS:
        if pat.match(name):
            return cls
    return None


def _family(cls: str) -> str:
    return "experts" if cls.startswith("experts") else cls


def parse_sets(items) -> dict[str, str]:
    """`--set` strings -> {class: format}; every invalid item is refused with its reason."""
    out: dict[str, str] = {}
    for item in items or ():
        if not isinstance(item, str) or item.count("=") != 1:
            raise SettingsError(f"--set {item!r}: expected CLASS=FORMAT, e.g. experts=q6")
        cls, fmt = (s.strip() for s in item.split("="))
        if not cls or not fmt:
            raise SettingsError(f"--set {item!r}: expected CLASS=FORMAT, e.g. experts=q6")
        if cls in LOCKED:
            raise SettingsError(f"--set {item}: class {cls!r} is locked and always stays raw: {LOCKED[cls]}")
        if cls not in CLASS_FORMATS:
            raise SettingsError(f"--set {item}: unknown class {cls!r}; classes: {', '.join(CLASS_FORMATS)} "
                                f"(locked, not settable: {', '.join(LOCKED)})")
        if fmt not in SET_FORMATS + ("q5",):
            raise SettingsError(f"--set {item}: unknown format {fmt!r}; formats: {', '.join(SET_FORMATS)}")
        if fmt not in CLASS_FORMATS[cls]:
            raise SettingsError(f"--set {item}: {cls} accepts {', '.join(CLASS_FORMATS[cls])} only: {CLASS_WHY_NOT[cls]}")
        if cls in out and out[cls] != fmt:
            raise SettingsError(f"--set {item}: class {cls!r} is already set to {out[cls]}")
        out[cls] = fmt
    return out


@dataclass(frozen=True)
class Policy:
    profile: str  # the base profile after expansion (nvfp4x -> q4)
    requested_profile: str  # what the user asked for
    overrides: dict = field(default_factory=dict)  # resolved {class: format}, nvfp4x's expansion included

    def format_of(self, name: str) -> str:
        cls = tensor_class(name)
        if cls is None:
            return "raw"
        base = _PROFILE_BASE[self.profile].get(_family(cls), "raw")
        return self.overrides.get(cls, self.overrides.get(_family(cls), base))

    def expert_format(self) -> str:
        return self.format_of("model.decoder.layers.0.experts.gate_up_proj")


def make_policy(profile: str, sets=()) -> Policy:
    """Validate a profile and its --set items (before any file is opened) into a Policy."""
    if profile not in PROFILES:
        raise SettingsError(f"--profile {profile!r}: unknown profile; profiles: {', '.join(PROFILES)}")
    overrides = parse_sets(sets)
    base = profile
    if profile == "nvfp4x":
        touched = [c for c in overrides if _family(c) == "experts"]
        if touched:
            raise SettingsError(f"--set {touched[0]}={overrides[touched[0]]}: --profile nvfp4x already fixes the experts "
                                "to nvfp4 (it is --profile q4 --set experts=nvfp4); use --profile q4 with your --set")
        base, overrides = "q4", {"experts": "nvfp4", **overrides}
    policy = Policy(profile=base, requested_profile=profile, overrides=overrides)
    gate_up = policy.format_of("model.decoder.layers.0.experts.gate_up_proj")
    down = policy.format_of("model.decoder.layers.0.experts.down_proj")
    if gate_up != down:
        raise SettingsError(f"--set: experts.gate_up resolves to {gate_up} but experts.down to {down}; they must match "
                            "(the grouped-GEMM dispatch and the blob byte math key on one shared expert format)")
    return policy
