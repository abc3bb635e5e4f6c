"""GenerationSettings: defaults, layering (generation_config <- hf preset <- env <- overrides), errors."""

import dataclasses
import json
import random

import pytest

from diffgemma.errors import SettingsError
from diffgemma.settings import FIELD_NAMES, HF_PRESET, GenerationSettings, register_env_var

DOCUMENTED_DEFAULTS = dict(
    entropy_bound=0.1, max_denoising_steps=48, t_min=0.4, t_max=0.8, stability_threshold=1,
    confidence_threshold=0.005, max_new_tokens=256, commit="argmax", sc_seed=True, sc_mode="sparse",
    sc_sparse_log_ratio=10.0, freeze=False, plateau_steps=8, plateau_entropy=0.05, pad_gate=True,
    entropy_stop=0.05, entropy_stop_min_steps=12, empty_reply_retry=3, confidence_trim=0.9, seed=0,
    canvas_length=None, stop_ids=None, stop_strings=(), semantics="contract",
    topk_attention=False, topk_divisor=128, topk_min=64, topk_max=512,
    grammar=None, grammar_fixes=8, grammar_reserve=32, tool_repair=False, tool_repair_attempts=2,
)


def test_defaults_are_the_documented_contract():
    s = GenerationSettings()
    assert s.as_dict() == DOCUMENTED_DEFAULTS
    assert set(FIELD_NAMES) == set(DOCUMENTED_DEFAULTS)
    assert GenerationSettings.resolve({}, env={}) == s
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.seed = 3


def test_generation_config_json_supplies_defaults():
    bound, steps = round(random.uniform(0.01, 1.0), 4), random.randint(1, 100)
    gc = {
        "sampler_config": {"entropy_bound": bound, "_cls_name": "EntropyBoundSamplerConfig"},
        "max_denoising_steps": steps, "t_min": 0.3, "t_max": None,  # null = unset
        "eos_token_id": [1, 106, 50], "pad_token_id": 0, "transformers_version": "5.24.0",
        "do_sample": True,  # belongs to autoregressive generation: ignored
    }
    s = GenerationSettings.resolve(gc, env={})
    assert (s.entropy_bound, s.max_denoising_steps, s.t_min, s.t_max) == (bound, steps, 0.3, 0.8)
    assert s.stop_ids == (1, 106, 50)
    assert GenerationSettings.resolve({"eos_token_id": 7}, env={}).stop_ids == (7,)
    with pytest.raises(SettingsError, match="max_denoising_steps.*generation_config.json"):
        GenerationSettings.resolve({"max_denoising_steps": "many"}, env={})


def test_layering_env_over_config_over_defaults_and_overrides_over_env():
    seed_env, seed_set = random.randint(0, 10**9), random.randint(0, 10**9)
    gc = {"max_new_tokens": 64, "t_min": 0.2}
    env = {"DIFFGEMMA_MAX_NEW_TOKENS": "100", "DIFFGEMMA_SEED": str(seed_env), "PATH": "/bin",
           "DIFFGEMMA_PAD_GATE": "off", "DIFFGEMMA_STOP_IDS": "1, 106,50"}
    s = GenerationSettings.resolve(gc, env=env)
    assert (s.max_new_tokens, s.seed, s.t_min, s.pad_gate, s.stop_ids) == (100, seed_env, 0.2, False, (1, 106, 50))
    s = GenerationSettings.resolve(gc, env=env, overrides=[f"seed={seed_set}", "max-new-tokens=7", "sc_mode=Exact"])
    assert (s.seed, s.max_new_tokens, s.sc_mode) == (seed_set, 7, "exact")
    s = GenerationSettings.resolve(gc, env=env, overrides={"seed": seed_set, "entropy_bound": 1, "freeze": "yes"})
    assert (s.seed, s.entropy_bound, s.freeze) == (seed_set, 1.0, True)
    assert isinstance(s.entropy_bound, float)


def test_hf_preset_and_what_overrides_it():
    s = GenerationSettings.resolve({}, env={}, overrides=["semantics=hf"])
    for name, value in HF_PRESET.items():
        assert getattr(s, name) == value
    assert (s.commit, s.sc_seed, s.sc_mode, s.empty_reply_retry, s.confidence_trim) == ("sample", False, "exact", 0, 0)
    assert s.max_denoising_steps == 48  # knobs transformers shares are untouched
    # one divergence re-enabled on top of the hf loop, from env or from --set
    assert GenerationSettings.resolve({}, env={"DIFFGEMMA_PAD_GATE": "1"}, overrides={"semantics": "hf"}).pad_gate
    assert GenerationSettings.resolve({}, env={"DIFFGEMMA_SEMANTICS": "hf"}, overrides=["commit=argmax"]).commit == "argmax"
    assert GenerationSettings.resolve({}, env={"DIFFGEMMA_SEMANTICS": "hf"}).commit == "sample"


@pytest.mark.parametrize("env, match", [
    ({"DIFFGEMMA_MAX_NEW_TOKEN": "5"}, "DIFFGEMMA_MAX_NEW_TOKEN"),  # typo'd name
    ({"DIFFGEMMA_SEED": "1.5"}, "seed"),
    ({"DIFFGEMMA_PAD_GATE": "maybe"}, "pad_gate"),
    ({"DIFFGEMMA_T_MIN": "nan"}, "t_min"),
    ({"DIFFGEMMA_COMMIT": "greedy"}, "commit.*argmax, sample"),
    ({"DIFFGEMMA_STOP_IDS": "1,x"}, "stop_ids"),
])
def test_bad_environment_is_an_error_naming_the_variable(env, match):
    with pytest.raises(SettingsError, match=match):
        GenerationSettings.resolve({}, env=env)


@pytest.mark.parametrize("overrides, match", [
    (["no_such_knob=1"], "unknown setting 'no_such_knob'"),
    (["seed"], "expected name=value"),
    (["max_denoising_steps=0"], "max_denoising_steps.*>= 1"),
    (["t_min=0.9", "t_max=0.5"], "t_max.*>= t_min"),
    (["confidence_trim=1.5"], "confidence_trim"),
    (["seed=-1"], "seed"),
    (["entropy_bound=-0.1"], "entropy_bound"),
    (["semantics=mlx"], "semantics"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"sc_seed": "sometimes"}, "sc_seed"),
    (["stop_strings=[1]"], "stop_strings.*non-empty texts"),
    (["stop_strings=[\"\"]"], "stop_strings"),
    (["stop_strings=[oops"], "stop_strings"),
    ({"stop_strings": ["a", None]}, "stop_strings"),
])
def test_bad_overrides_are_errors_naming_the_field(overrides, match):
    with pytest.raises(SettingsError, match=match):
        GenerationSettings.resolve({}, env={}, overrides=overrides)


def test_constructor_and_replace_validate_too():
    with pytest.raises(SettingsError, match="plateau_steps"):
        GenerationSettings(plateau_steps=-1)
    with pytest.raises(SettingsError, match="entropy_bound"):
        GenerationSettings(entropy_bound="lots")
    s = GenerationSettings(entropy_bound=1, stop_ids=[1, 106])
    assert s.entropy_bound == 1.0 and isinstance(s.entropy_bound, float) and s.stop_ids == (1, 106)
    n = random.randint(1, 512)
    assert GenerationSettings().replace(max_new_tokens=str(n), entropy_bound=1).max_new_tokens == n
    with pytest.raises(SettingsError, match="unknown setting"):
        GenerationSettings().replace(bogus=1)


def test_foreign_diffgemma_variables_can_be_registered():
    name = f"DIFFGEMMA_TEST_OTHER_{random.randint(0, 10**6)}"
    with pytest.raises(SettingsError, match=name):
        GenerationSettings.resolve({}, env={name: "x"})
    register_env_var(name)
    assert GenerationSettings.resolve({}, env={name: "x"}) == GenerationSettings()
    # the variables other modules read today are known without registering
    assert GenerationSettings.resolve({}, env={"DIFFGEMMA_NO_TRITON": "1", "DIFFGEMMA_HF_HOME": "/x",
                                                 "DIFFGEMMA_EXPERT_GEMM": "cutlass",
                                                 "DIFFGEMMA_PACKED_PREFILL": "kernel"}) == GenerationSettings()


def test_every_variable_the_package_reads_is_known():
    """A DIFFGEMMA_* variable some module reads but settings does not know makes every generate call fail
    with 'unknown environment variable'. Modules read them directly or through a `*_ENV = "DIFFGEMMA_..."` name."""
    import re
    from pathlib import Path

    import diffgemma

    root = Path(diffgemma.__file__).parent
    read = set()
    for f in root.rglob("*.py"):
        text = f.read_text()
        read |= set(re.findall(r"""environ(?:\.get\(|\[)\s*["'](DIFFGEMMA_[A-Z0-9_]+)["']""", text))
        read |= set(re.findall(r"""_ENV\s*=\s*["'](DIFFGEMMA_[A-Z0-9_]+)["']""", text))
    assert {"DIFFGEMMA_PACKED_PREFILL", "DIFFGEMMA_EXPERT_GEMM"} <= read and "DIFFGEMMA_NO_TRITON" in read and "DIFFGEMMA_NO_TRITON" in read  # the scan sees them
    for name in sorted(read):
        GenerationSettings.resolve({}, env={name: "1"})  # no SettingsError


def test_import_defaults_expandable_segments_and_respects_the_user():
    import subprocess
    import sys

    code = "import os, diffgemma; print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))"
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "expandable_segments:True"
    env["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size_mb:128"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "max_split_size_mb:128"


def test_stop_strings_from_every_way_in():
    """A Python str is one text as it is; from env / --set a text starting with '[' is a JSON array of texts (so one
    flag can carry several, newlines included), any other is one text, and '' is none."""
    assert GenerationSettings(stop_strings=" 45").stop_strings == (" 45",)
    assert GenerationSettings(stop_strings=["a", "b"]).stop_strings == ("a", "b")
    assert GenerationSettings.resolve({}, env={}, overrides=["stop_strings=Observation:"]).stop_strings == (
        "Observation:",)
    env = {"DIFFGEMMA_STOP_STRINGS": '["\\n\\n", "</tool>"]'}
    assert GenerationSettings.resolve({}, env=env).stop_strings == ("\n\n", "</tool>")
    assert GenerationSettings.resolve({}, env={}, overrides=["stop_strings="]).stop_strings == ()
    s = GenerationSettings(stop_strings=["x"])
    assert GenerationSettings(**json.loads(json.dumps(s.as_dict()))) == s  # as the op-log writes and replay reads
