"""GenerationSettings: every knob of the generation contract, typed, validated, with its default.

docs/ARCHITECTURE.md ('Generation contract') defines the loop; each divergence from transformers there is
a named field here rather than a scattered `if`. Values are layered, later layers winning:

    field defaults  <-  the model's generation_config.json  <-  the "hf" preset (when semantics="hf")
                    <-  DIFFGEMMA_<FIELD> environment variables  <-  explicit overrides (kwargs / --set)

The "hf" preset sits below env and overrides on purpose: `semantics=hf pad_gate=1` is a legal A/B arm
that re-enables one divergence on top of transformers' loop.

Every way in (constructor, env, --set string) goes through the same validation, and a bad name or
value raises SettingsError naming the field, where it came from, and what was expected.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, fields
from typing import Any, Iterable, Mapping

from .errors import SettingsError

ENV_PREFIX = "DIFFGEMMA_"

# DIFFGEMMA_* variables owned by other parts of the package (model path, device, kernels, ...). An
# unknown DIFFGEMMA_* variable is an error (a typo'd arm must die before any model load), so other
# modules declare theirs here through register_env_var(), or are listed with their owner below (a module
# that is not imported before resolve() runs cannot register in time).
_FOREIGN_ENV_VARS: set[str] = {
    "DIFFGEMMA_NO_TRITON",  # ops/_backend.py: force the torch path on CUDA
    "DIFFGEMMA_HF_HOME",  # quant/externals.py: Hugging Face cache root for overlay packs
    "DIFFGEMMA_EXPERT_GEMM",  # ops/moe_paths.py: the bf16 denoise and FP8 expert GEMMs, "triton" or "cutlass"
    "DIFFGEMMA_PACKED_PREFILL",  # ops/moe_paths.py: packed experts at prefill, "dequant" or "kernel"
    "DIFFGEMMA_Q4_LAYOUT",  # ops/q4_tiles.py: q4 expert stacks on CUDA, "q4-tiles" or "natural"
    "DIFFGEMMA_API_KEY",  # server/commands.py: the key `serve` asks clients for (--api-key)
    "DIFFGEMMA_DIST_TIMEOUT",  # parallel/group.py: seconds a collective of an expert-parallel run may take
}


def register_env_var(name: str) -> None:
    """Declare a DIFFGEMMA_* variable that belongs to another module, so resolve() does not reject it."""
    if not name.startswith(ENV_PREFIX):
        raise ValueError(f"environment variable {name!r} must start with {ENV_PREFIX!r}")
    _FOREIGN_ENV_VARS.add(name)


@dataclass(frozen=True)
class GenerationSettings:
    # --- transformers' generation_config.json knobs (same names) -------------------------------------
    entropy_bound: float = 0.1  # nats; accept the lowest-entropy prefix while sum(H) - max(H) <= bound
    max_denoising_steps: int = 48
    t_min: float = 0.4  # temperature at the last scheduled step
    t_max: float = 0.8  # temperature at the first step
    stability_threshold: int = 1  # confident stop: argmax equal to the last N steps' (0 = always stable)
    confidence_threshold: float = 0.005  # confident stop: mean canvas entropy below this
    max_new_tokens: int = 256  # honoured exactly
    # --- contract divergences (docs/ARCHITECTURE.md, 'Generation contract') ----------------------------
    commit: str = "argmax"  # token at accepted positions: "argmax" or "sample" (tempered categorical)
    sc_seed: bool = True  # first denoise step self-conditions on the canvas's own embedding
    # "sparse" (survivor gather) or "exact" (dense probs @ embedding). Sparse is the default: at the real
    # vocabulary the gather reads a few embedding rows a canvas row, the exact product the whole table
    # (sampling/self_condition.py; docs/ARCHITECTURE.md, 'Self-conditioning'); flat rows (random weights)
    # fall back to the dense product.
    sc_mode: str = "sparse"
    sc_sparse_log_ratio: float = 10.0  # sparse SC keeps tokens with prob >= exp(-ratio) * row max
    freeze: bool = False  # legacy: accepted positions stay fixed (A/B only; causes warts)
    plateau_steps: int = 8  # plateau stop: accept mask unchanged this many steps (0 disables)
    plateau_entropy: float = 0.05  # ... and mean entropy below this
    pad_gate: bool = True  # an all-pad/filler argmax never counts as converged
    entropy_stop: float = 0.05  # entropy-only stop threshold on mean entropy (0 disables)
    entropy_stop_min_steps: int = 12  # ... which may fire only from this step on (1-based)
    empty_reply_retry: int = 3  # re-rolls of a first block that opens with a stop/control token
    confidence_trim: float = 0.9  # commit-time trim tau (0 disables)
    seed: int = 0
    canvas_length: int | None = None  # None = the model's canvas_length
    stop_ids: tuple[int, ...] | None = None  # None = generation_config eos_token_id, else config eos ids
    # Texts that end the reply (OpenAI's `stop`): matched in the decoded reply after each committed block; the reply
    # ends at the first match, which the returned text leaves out (generation.py, stop_strings.py)
    stop_strings: tuple[str, ...] = ()
    semantics: str = "contract"  # "contract" (docs/ARCHITECTURE.md) or "hf" (transformers' generate())
    # Top-k sparse attention on the full-attention layers (prefill and denoise; changes tokens, off by default): each
    # query row attends to its k best-scoring keys, k = clamp(visible keys // topk_divisor, topk_min, topk_max)
    # (ops/attention_topk.py; docs/ARCHITECTURE.md, 'Generation contract')
    topk_attention: bool = False
    topk_divisor: int = 128
    topk_min: int = 64
    topk_max: int = 512
    # A grammar the reply must match, in llguidance's serialized form (sampling/constraint.py; grammars.py makes it
    # from a JSON schema or a tool list). None: unconstrained. Journaled with the other settings, so replay re-runs it
    grammar: str | None = None
    grammar_fixes: int = 8  # frontier positions a constrained step may correct with the grammar's masked argmax
    grammar_reserve: int = 32  # the last tokens of a constrained reply's budget close the grammar (sampling/constraint)
    # A chat turn's tool repair (core/turn.py; docs/ARCHITECTURE.md, 'Tool repair'): a reply with an invalid tool call
    # gets an error tool-response per invalid call and is written again, at most tool_repair_attempts times
    tool_repair: bool = False
    tool_repair_attempts: int = 2

    def __post_init__(self):
        # coerce lenient-but-unambiguous values (1 -> 1.0 for a float, [1, 2] -> (1, 2)), reject the rest
        for f in fields(self):
            object.__setattr__(self, f.name, _parse(f.name, getattr(self, f.name), "value"))
        _check_ranges(self)

    # ------------------------------------------------------------------------------------------------
    def replace(self, **changes: Any) -> "GenerationSettings":
        """A copy with some fields changed (values are parsed like overrides: "0.2" is fine for a float)."""
        parsed = {name: _parse(name, value, "override") for name, value in _check_names(changes, "override").items()}
        return dataclasses.replace(self, **parsed)

    @classmethod
    def preset(cls, semantics: str) -> dict[str, Any]:
        """The field values a semantics preset implies ({} for "contract": the defaults are the contract)."""
        if semantics == "hf":
            return dict(HF_PRESET)
        if semantics == "contract":
            return {}
        raise SettingsError(f"semantics: unknown value {semantics!r}, expected one of {SEMANTICS}")

    @classmethod
    def resolve(
        cls,
        model_generation_config: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        overrides: Mapping[str, Any] | Iterable[str] | None = None,
    ) -> "GenerationSettings":
        """Layer generation_config.json <- hf preset <- DIFFGEMMA_* env <- overrides, validating everything.

        `env` defaults to os.environ; pass {} to ignore the environment. `overrides` is a dict of
        field -> value, or a list of "name=value" strings (the CLI's --set).
        """
        if env is None:
            env = os.environ
        from_model = _from_generation_config(model_generation_config or {})
        from_env = _from_env(env)
        from_overrides = parse_overrides(overrides)

        semantics = from_overrides.get("semantics", from_env.get("semantics", from_model.get("semantics", "contract")))
        values: dict[str, Any] = {}
        values.update(from_model)
        values.update(cls.preset(semantics))
        values.update(from_env)
        values.update(from_overrides)
        try:
            return cls(**values)
        except SettingsError:
            raise
        except TypeError as e:  # pragma: no cover - names are checked above
            raise SettingsError(str(e)) from None

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def settings_for_call(
    model_generation_config: Mapping[str, Any] | None,
    settings: GenerationSettings | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> GenerationSettings:
    """The settings of one call: explicit `settings` with the call's `overrides` on top, or, with none given, the
    model's generation_config <- DIFFGEMMA_* env <- overrides (`GenerationSettings.resolve`)."""
    if settings is None:
        return GenerationSettings.resolve(model_generation_config or {}, env=os.environ, overrides=overrides)
    return settings.replace(**overrides) if overrides else settings


SEMANTICS = ("contract", "hf")
COMMITS = ("argmax", "sample")
SC_MODES = ("sparse", "exact")

# transformers' generate(): tempered categorical draw, no first-step SC seed, only the stable-and-
# confident stop, no re-roll / trim / plateau / pad gate / entropy stop, exact SC.
HF_PRESET: dict[str, Any] = {
    "commit": "sample",
    "sc_seed": False,
    "sc_mode": "exact",
    "freeze": False,
    "plateau_steps": 0,
    "pad_gate": False,
    "entropy_stop": 0.0,
    "empty_reply_retry": 0,
    "confidence_trim": 0.0,
    "topk_attention": False,
}

_FIELD_TYPES: dict[str, str] = {
    "entropy_bound": "float",
    "max_denoising_steps": "int",
    "t_min": "float",
    "t_max": "float",
    "stability_threshold": "int",
    "confidence_threshold": "float",
    "max_new_tokens": "int",
    "commit": "choice",
    "sc_seed": "bool",
    "sc_mode": "choice",
    "sc_sparse_log_ratio": "float",
    "freeze": "bool",
    "plateau_steps": "int",
    "plateau_entropy": "float",
    "pad_gate": "bool",
    "entropy_stop": "float",
    "entropy_stop_min_steps": "int",
    "empty_reply_retry": "int",
    "confidence_trim": "float",
    "seed": "int",
    "canvas_length": "optional_int",
    "stop_ids": "optional_ids",
    "stop_strings": "strings",
    "semantics": "choice",
    "topk_attention": "bool",
    "topk_divisor": "int",
    "topk_min": "int",
    "topk_max": "int",
    "grammar": "optional_text",
    "grammar_fixes": "int",
    "grammar_reserve": "int",
    "tool_repair": "bool",
    "tool_repair_attempts": "int",
}
_CHOICES = {"commit": COMMITS, "sc_mode": SC_MODES, "semantics": SEMANTICS}
FIELD_NAMES = tuple(_FIELD_TYPES)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

# generation_config.json keys transformers writes that are not sampler knobs: ignored on purpose.
# (max_length is transformers' alternative to max_new_tokens; diffgemma honours max_new_tokens only.)
_GENCONFIG_IGNORED = {
    "bos_token_id", "pad_token_id", "transformers_version", "_from_model_config", "_commit_hash",
    "return_dict_in_generate", "cache_implementation", "cache_config", "disable_compile", "max_length",
}


def _expected(name: str) -> str:
    kind = _FIELD_TYPES[name]
    if kind == "choice":
        return "one of " + ", ".join(_CHOICES[name])
    return {
        "float": "a finite number",
        "int": "an integer",
        "bool": "a boolean (1/0, true/false, yes/no, on/off)",
        "optional_int": "a positive integer or 'none'",
        "optional_ids": "a comma-separated list of token ids or 'none'",
        "strings": "non-empty texts: one text, or a JSON array of them ('[\"a\", \"b\"]'; '' for none)",
        "optional_text": "a non-empty text or 'none'",
    }[kind]


def _check_type(name: str, value: Any, origin: str) -> None:
    kind = _FIELD_TYPES[name]
    ok = {
        "float": isinstance(value, float) and math.isfinite(value),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "choice": isinstance(value, str) and value in _CHOICES.get(name, ()),
        "optional_int": value is None or (isinstance(value, int) and not isinstance(value, bool)),
        "optional_ids": value is None
        or (isinstance(value, tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)),
        "strings": isinstance(value, tuple) and all(isinstance(v, str) and v for v in value),
        "optional_text": value is None or (isinstance(value, str) and bool(value)),
    }[kind]
    if not ok:
        raise SettingsError(f"{name} ({origin}): got {value!r}, expected {_expected(name)}")


def _check_ranges(s: GenerationSettings) -> None:
    def need(cond: bool, name: str, what: str):
        if not cond:
            raise SettingsError(f"{name}: got {getattr(s, name)!r}, expected {what}")

    need(s.entropy_bound >= 0, "entropy_bound", "a number >= 0 (nats)")
    need(s.max_denoising_steps >= 1, "max_denoising_steps", "an integer >= 1")
    need(s.t_min >= 0, "t_min", "a temperature >= 0")
    need(s.t_max > 0 and s.t_max >= s.t_min, "t_max", f"a temperature > 0 and >= t_min ({s.t_min})")
    need(s.stability_threshold >= 0, "stability_threshold", "an integer >= 0")
    need(s.confidence_threshold >= 0, "confidence_threshold", "a number >= 0 (nats)")
    need(s.max_new_tokens >= 1, "max_new_tokens", "an integer >= 1")
    need(s.sc_sparse_log_ratio > 0, "sc_sparse_log_ratio", "a number > 0")
    need(s.plateau_steps >= 0, "plateau_steps", "an integer >= 0 (0 disables)")
    need(s.plateau_entropy >= 0, "plateau_entropy", "a number >= 0 (nats)")
    need(s.entropy_stop >= 0, "entropy_stop", "a number >= 0 (nats; 0 disables)")
    need(s.entropy_stop_min_steps >= 1, "entropy_stop_min_steps", "an integer >= 1")
    need(s.empty_reply_retry >= 0, "empty_reply_retry", "an integer >= 0 (0 disables)")
    need(0 <= s.confidence_trim <= 1, "confidence_trim", "a probability in [0, 1] (0 disables)")
    need(0 <= s.seed < 2**64, "seed", "an integer in [0, 2**64)")
    need(s.canvas_length is None or s.canvas_length >= 1, "canvas_length", "a positive integer or None")
    need(s.stop_ids is None or all(v >= 0 for v in s.stop_ids), "stop_ids", "non-negative token ids")
    need(s.topk_divisor >= 1, "topk_divisor", "an integer >= 1")
    need(s.topk_min >= 1, "topk_min", "an integer >= 1")
    need(s.topk_max >= s.topk_min, "topk_max", f"an integer >= topk_min ({s.topk_min})")
    need(s.grammar_fixes >= 1, "grammar_fixes", "an integer >= 1")
    need(s.grammar_reserve >= 0, "grammar_reserve", "an integer >= 0")
    need(s.tool_repair_attempts >= 1, "tool_repair_attempts", "an integer >= 1")


def _parse(name: str, value: Any, origin: str) -> Any:
    """Turn a user value (typed, or a string from env / --set) into the field's type, or raise."""
    kind = _FIELD_TYPES[name]

    def bad():
        return SettingsError(f"{name} ({origin}): got {value!r}, expected {_expected(name)}")

    if kind == "strings" and isinstance(value, str):
        # one text as it is (whitespace counts), or from env / --set a JSON array of texts, or '' for none
        if origin == "value" or not value.lstrip().startswith("["):
            value = (value,) if value else ()
        else:
            try:
                value = json.loads(value)
            except ValueError:
                raise bad() from None
    if kind == "optional_text" and isinstance(value, str):
        if value.strip().lower() in ("none", ""):
            return None
        return value
    if isinstance(value, str):
        text = value.strip()
        low = text.lower()
        try:
            if kind == "float":
                parsed = float(text)
                if not math.isfinite(parsed):
                    raise bad()
                return parsed
            if kind == "int":
                return int(text, 10)
            if kind == "bool":
                if low in _TRUE:
                    return True
                if low in _FALSE:
                    return False
                raise bad()
            if kind == "choice":
                if low not in _CHOICES[name]:
                    raise bad()
                return low
            if kind == "optional_int":
                return None if low in ("none", "") else int(text, 10)
            if kind == "optional_ids":
                if low in ("none", ""):
                    return None
                return tuple(int(part, 10) for part in text.replace(" ", "").split(","))
        except ValueError:
            raise bad() from None
        raise bad()

    if kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = float(value)
    elif kind == "bool" and isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
        value = bool(value)
    elif kind == "int" and isinstance(value, float) and value.is_integer():
        value = int(value)
    elif kind == "optional_ids" and isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    elif kind == "strings" and isinstance(value, (list, tuple)):
        value = tuple(value)
    elif kind == "optional_ids" and isinstance(value, (list, tuple, set, frozenset)):
        value = tuple(sorted(value)) if isinstance(value, (set, frozenset)) else tuple(value)
    _check_type(name, value, origin)
    return value


def _check_names(values: Mapping[str, Any], origin: str) -> dict[str, Any]:
    out = {}
    for raw_name, value in values.items():
        name = str(raw_name).strip().replace("-", "_").lower()
        if name not in _FIELD_TYPES:
            raise SettingsError(f"unknown setting {raw_name!r} ({origin}); known settings: {', '.join(FIELD_NAMES)}")
        out[name] = value
    return out


def _from_generation_config(gc: Mapping[str, Any]) -> dict[str, Any]:
    """Read transformers' generation_config.json keys; unrelated keys are ignored, bad values are errors."""
    if not isinstance(gc, Mapping):
        raise SettingsError(f"generation_config.json: expected a JSON object, got {type(gc).__name__}")
    origin = "generation_config.json"
    out: dict[str, Any] = {}
    sampler = gc.get("sampler_config")
    if isinstance(sampler, Mapping) and sampler.get("entropy_bound") is not None:
        out["entropy_bound"] = _parse("entropy_bound", sampler["entropy_bound"], origin + " sampler_config")
    elif sampler is not None and not isinstance(sampler, Mapping):
        bound = getattr(sampler, "entropy_bound", None)  # an EntropyBoundSamplerConfig object
        if bound is not None:
            out["entropy_bound"] = _parse("entropy_bound", bound, origin + " sampler_config")
    for key, value in gc.items():
        if value is None or key in _GENCONFIG_IGNORED or key == "sampler_config":
            continue
        if key == "eos_token_id":
            out["stop_ids"] = _parse("stop_ids", value, origin + " eos_token_id")
        elif key in _FIELD_TYPES:
            out[key] = _parse(key, value, origin)
        # anything else (do_sample, temperature, ...) belongs to other generation styles: ignored
    return out


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in env.items():
        if not key.startswith(ENV_PREFIX) or key in _FOREIGN_ENV_VARS:
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name not in _FIELD_TYPES:
            known = ", ".join(ENV_PREFIX + n.upper() for n in FIELD_NAMES)
            raise SettingsError(f"unknown environment variable {key}; known: {known}")
        out[name] = _parse(name, value, f"environment {key}")
    return out


def parse_overrides(overrides: Mapping[str, Any] | Iterable[str] | None) -> dict[str, Any]:
    if overrides is None:
        return {}
    if isinstance(overrides, Mapping):
        return {n: _parse(n, v, "override") for n, v in _check_names(overrides, "override").items()}
    if isinstance(overrides, str):
        overrides = [overrides]
    out: dict[str, Any] = {}
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise SettingsError(f"--set {item!r}: expected name=value")
        name, value = item.split("=", 1)
        (name,) = _check_names({name: value}, f"--set {item}")
        out[name] = _parse(name, value, f"--set {item}")
    return out
