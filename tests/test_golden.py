"""Golden byte-identity on the embedded demo model: token ids and KV hashes pinned per case."""

import json

import pytest

import diffgemma
from diffgemma import golden
from diffgemma.errors import CheckpointError


@pytest.fixture(scope="module")
def demo():
    return diffgemma.load()


def test_golden_cases_are_byte_identical(demo):
    expected = golden.load_fixture(golden.fixture_path(demo))
    assert set(expected) == {c.name for c in golden.CASES}
    got = golden.run_all(demo)
    problems = golden.diff(expected, got)
    assert not problems, "\n".join(problems) + "\n(if the change is intended: diffgemma golden --bless)"


def test_the_matrix_exercises_what_it_claims():
    cases = golden.load_fixture(golden.fixture_path(diffgemma.load()))
    assert len(cases["multi_block"]["steps_per_block"]) > 1
    assert cases["empty_reply_retry"]["retries"] > 0
    assert "<|channel>thought" in cases["thinking_on"]["text"]
    assert cases["tool_call"]["text"].startswith("<|tool_call>call:get_weather")


def test_diff_names_the_first_differing_token_and_bless_is_atomic(tmp_path):
    base = {"a": {"tokens": [1, 2, 3], "text": "x", "steps_per_block": [2], "stop_reasons": ["confident"],
                  "retries": 0, "kv_sha256": "00"}}
    changed = json.loads(json.dumps(base))
    changed["a"]["tokens"][1] = 9
    changed["a"]["kv_sha256"] = "11"
    lines = golden.diff(base, changed)
    assert any("tokens differ from index 1" in l for l in lines) and any("kv_sha256" in l for l in lines)
    assert golden.diff(base, base) == []
    path = tmp_path / "golden.json"
    golden.bless(base, path)
    assert golden.load_fixture(path) == base
    with pytest.raises(TypeError):
        golden.bless({"a": object()}, path)  # not serialisable: the old fixture must survive
    assert golden.load_fixture(path) == base and len(list(tmp_path.iterdir())) == 1


def test_kv_hashes_are_kept_per_platform_and_added_only_for_the_same_run():
    """A case keeps one KV hash per platform blessed (float kernels differ in the last bits between CPUs): a run
    passes with any of them, and a platform's hash is added only when tokens, steps, stops and retries match."""
    base = {"a": {"tokens": [1, 2, 3], "text": "x", "steps_per_block": [2], "stop_reasons": ["confident"],
                  "retries": 0, "kv_sha256": "00"}}
    other = json.loads(json.dumps(base))
    other["a"]["kv_sha256"] = "11"
    assert any("kv_sha256 expected one of ['00']" in l for l in golden.diff(base, other))
    both = golden.add_platform(base, other)
    assert both["a"]["kv_sha256"] == ["00", "11"] and base["a"]["kv_sha256"] == "00"
    assert golden.diff(both, other) == [] and golden.diff(both, base) == []
    assert golden.add_platform(both, other) == both  # a hash is listed once
    third = json.loads(json.dumps(other))
    third["a"]["kv_sha256"] = "22"
    assert golden.diff(both, third)  # a third hash is not in the list
    third["a"]["tokens"][2] = 9
    with pytest.raises(CheckpointError, match="tokens differ"):
        golden.add_platform(both, third)


def test_an_unblessed_platform_passes_on_its_kv_statistics_only_within_tolerance():
    """Another CPU's KV bits (a hash not listed) pass when tokens, steps and stops match and the KV statistics lie
    within KV_RTOL; they are reported as unpinned. Statistics further off, or a fixture without them, fail."""
    base = {"a": {"tokens": [1, 2, 3], "text": "x", "steps_per_block": [2], "stop_reasons": ["confident"],
                  "retries": 0, "kv_sha256": ["00"], "kv_stats": [[10.0, 2.0], [5.0, 1.0]]}}
    near = json.loads(json.dumps(base))
    near["a"]["kv_sha256"] = "11"
    near["a"]["kv_stats"][1][0] *= 1 + golden.KV_RTOL / 4
    assert golden.diff(base, near) == [] and golden.unpinned(base, near) == ["a"]
    same = json.loads(json.dumps(near))
    same["a"]["kv_sha256"] = "00"
    assert golden.unpinned(base, same) == []
    far = json.loads(json.dumps(near))
    far["a"]["kv_stats"][1][0] *= 1 + 4 * golden.KV_RTOL
    assert any("not within" in line for line in golden.diff(base, far))
    short = json.loads(json.dumps(near))
    short["a"]["kv_stats"] = short["a"]["kv_stats"][:1]
    assert golden.diff(base, short)
    bare = json.loads(json.dumps(base))
    del bare["a"]["kv_stats"]
    assert golden.diff(bare, near)  # nothing to compare against: the hash must match
    changed = json.loads(json.dumps(near))
    changed["a"]["tokens"][0] = 7
    assert any("tokens differ" in line for line in golden.diff(base, changed))
    assert golden.add_platform(base, near)["a"]["kv_sha256"] == ["00", "11"]
