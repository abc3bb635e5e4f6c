"""The shipped demo's generation_config.json is in the hub's format: transformers loads it unmodified, and diffgemma
reads the same knobs from it as from the older flat form (entropy_bound at the top level)."""

import json

import pytest

from diffgemma.loader import embedded_model_path
from diffgemma.settings import GenerationSettings

DEMO = embedded_model_path()


def test_transformers_loads_the_demo_generation_config():
    hfgen = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")
    config = hfgen.DiffusionGemmaGenerationConfig.from_pretrained(DEMO)
    assert isinstance(config.sampler_config, hfgen.EntropyBoundSamplerConfig)
    assert config.sampler_config.entropy_bound == 0.1
    assert (config.max_denoising_steps, config.t_min, config.t_max, config.max_new_tokens) == (48, 0.4, 0.8, 256)
    config.validate()


def test_both_forms_give_the_same_settings():
    hub = json.loads((DEMO / "generation_config.json").read_text())
    assert hub["sampler_config"] == {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1}
    assert "entropy_bound" not in hub
    flat = {k: v for k, v in hub.items() if k != "sampler_config"} | {"entropy_bound": 0.1}
    a, b = (GenerationSettings.resolve(gc, env={}) for gc in (hub, flat))
    assert a == b and a.entropy_bound == 0.1 and a.stop_ids == (1, 106, 50)
    other = dict(hub, sampler_config={"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.25})
    assert GenerationSettings.resolve(other, env={}).entropy_bound == 0.25
