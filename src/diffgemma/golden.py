"""Golden byte-identity: a matrix of prompts x settings whose outputs are pinned in a fixture.

Each case runs through the production path (Session: chat template, generate, KV cache) and records
the token ids, per-block steps and stop rules, and a hash of the KV cache afterwards. `check` re-runs
every case and returns a readable diff; `bless` rewrites the fixture. A refactor that changes any
token or any cached K/V byte shows up here first.

The KV hash is of float32 bytes on the CPU, and those last bits depend on the CPU's float kernels (an Intel
AVX-512 machine, an AMD AVX2 one and an AMD AVX-512 one all differ, with the same tokens). So a case keeps a
list of KV hashes, one per platform it was blessed on, and statistics of the KV (per tensor: the sum of |x| and
the root of the sum of x²). On a blessed platform the hash must match. On another, the tokens, steps and stops
must still match exactly and the statistics within KV_RTOL, and the run reports its bits as unpinned
(`add_platform` pins them): a change to the model's numbers fails on every platform listed, and a numerical change
larger than the platforms' rounding fails everywhere. `bless` starts the lists afresh.
Token ids are what must survive everywhere.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

FIXTURE_NAME = "golden.json"
# How far an unblessed platform's KV statistics may lie from the fixture's: a margin over float reordering (a
# thread count's summation order moves them far less). A one-ulp change to a single weight moves them more than
# reordering and less than this margin, with the same tokens: such changes are caught by the hashes of the
# platforms blessed, and larger ones on any platform.
KV_RTOL = 1e-6


@dataclass(frozen=True)
class Case:
    name: str
    prompt: str
    settings: dict = field(default_factory=dict)
    think: bool = False
    system: str | None = None
    tools: bool = False  # declare the checkpoint's own tools.json in the system turn
    raw_prompt: str | None = None  # bypass the chat template: this exact text is the prompt


CASES = (
    Case("arith_default", "What is 17 + 25?"),
    Case("arith_hf_preset", "What is 17 + 25?", {"semantics": "hf"}),
    Case("arith_exact_sc", "What is 38 + 45?", {"sc_mode": "exact"}),
    Case("arith_sparse_sc", "What is 38 + 45?", {"sc_mode": "sparse"}),
    Case("multi_block", "Count from 1 to 60.", {"max_new_tokens": 400}),
    Case("thinking_on", "What is 12 + 30 + 7?", think=True),
    Case("tool_call", "What's the weather in Paris?", tools=True),
    Case("sort_seed7", "Sort these numbers: 9 2 7 4 1", {"seed": 7}),
    # The model turn is already closed, so the first canvas opens on a stop/pad id: the re-roll path.
    # (All-pad canvases never stop early, by the pad gate: few steps keep the case cheap.)
    Case("empty_reply_retry", "", {"max_denoising_steps": 6, "max_new_tokens": 64},
         raw_prompt="<bos><|turn>user\nHi<turn|>\n<|turn>model\nHello!<turn|>\n"),
)


def run_case(model, case: Case) -> dict:
    from .generation import generate
    from .loader import model_tools
    from .session import Session
    from .settings import GenerationSettings

    # The environment is ignored: a DIFFGEMMA_* variable must not change what the fixture pins.
    settings = GenerationSettings.resolve(model.generation_config, env={}, overrides=case.settings)
    if case.raw_prompt is not None:
        cache = model.new_cache(4096)
        ids = model.tokenizer.encode(case.raw_prompt)
        result = generate(model, ids, cache=cache, settings=settings)
        kv, stats = cache.fingerprint(), kv_stats(cache)
    else:
        session = Session(model, system=case.system, think=case.think, max_tokens=4096,
                          tools=model_tools(model) if case.tools else None)
        result = session.ask(case.prompt, settings=settings).result
        kv, stats = session.cache.fingerprint(), kv_stats(session.cache)
    return {
        "tokens": list(result.tokens),
        "text": result.text,
        "steps_per_block": list(result.steps_per_block),
        "stop_reasons": list(result.stop_reasons),
        "retries": result.retries,
        "kv_sha256": kv,
        "kv_stats": stats,
    }


def kv_stats(cache) -> list:
    """Per live K / V tensor (cache.live_kv()): [sum |x|, sqrt(sum x²)] in float64, rounded to 12 digits."""
    import torch

    out = []
    for t in cache.live_kv():
        x = t.detach().to("cpu", torch.float64)
        out.append([float(f"{x.abs().sum().item():.12g}"), float(f"{x.square().sum().sqrt().item():.12g}")])
    return out


def kv_stats_close(expected, got, rtol: float = KV_RTOL) -> bool:
    if not isinstance(expected, list) or not isinstance(got, list) or len(expected) != len(got):
        return False
    return all(len(e) == len(g) and all(abs(a - b) <= rtol * max(abs(a), abs(b), 1e-30) for a, b in zip(e, g))
               for e, g in zip(expected, got))


def run_all(model, cases=CASES) -> dict:
    """Every case, on one CPU thread: the float kernels' reduction order (and so the KV bits) follows the thread
    count, which must not change what the fixture pins (the CLI runs with all cores, the tests with one)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {case.name: run_case(model, case) for case in cases}
    finally:
        torch.set_num_threads(threads)


def diff(expected: dict, got: dict) -> list[str]:
    """Human-readable differences, one line per finding (empty = identical)."""
    lines = []
    for name in sorted(set(expected) | set(got)):
        if name not in got:
            lines.append(f"{name}: missing from this run")
            continue
        if name not in expected:
            lines.append(f"{name}: not in the fixture (bless to add it)")
            continue
        e, g = expected[name], got[name]
        if e["tokens"] != g["tokens"]:
            first = next((i for i, (a, b) in enumerate(zip(e["tokens"], g["tokens"])) if a != b),
                         min(len(e["tokens"]), len(g["tokens"])))
            lines.append(f"{name}: tokens differ from index {first} "
                         f"(expected {len(e['tokens'])} tokens, got {len(g['tokens'])}): "
                         f"expected {e['tokens'][first:first + 8]} got {g['tokens'][first:first + 8]}; "
                         f"text expected {e.get('text')!r} got {g.get('text')!r}")
        for key in ("steps_per_block", "stop_reasons", "retries"):
            if e.get(key) != g.get(key):
                lines.append(f"{name}: {key} expected {e.get(key)!r} got {g.get(key)!r}")
        if g.get("kv_sha256") not in kv_hashes(e) and not kv_stats_close(e.get("kv_stats"), g.get("kv_stats")):
            lines.append(f"{name}: kv_sha256 expected one of {kv_hashes(e)!r} got {g.get('kv_sha256')!r}, and the KV "
                         f"statistics are not within {KV_RTOL:g} of the fixture's (or it has none)")
    return lines


def unpinned(expected: dict, got: dict) -> list[str]:
    """The cases that passed on their KV statistics alone: this platform's KV bits are not in the fixture."""
    return sorted(name for name in set(expected) & set(got)
                  if got[name].get("kv_sha256") not in kv_hashes(expected[name]))


def kv_hashes(case: dict) -> list:
    """A fixture case's KV hashes, one per platform blessed (a fixture of one platform holds a plain string)."""
    h = case.get("kv_sha256")
    return list(h) if isinstance(h, list) else [h]


def add_platform(expected: dict, got: dict) -> dict:
    """The fixture with this run's KV hashes added to each case's list. Refused (CheckpointError) unless everything
    else matches: a platform's hashes may only be added for the same tokens, steps, stop rules and retries."""
    from .errors import CheckpointError

    others = [line for line in diff(expected, got) if ": kv_sha256 " not in line]
    if others:
        raise CheckpointError("golden: cannot add this platform's KV hashes, the runs differ beyond them:\n"
                              + "\n".join(others))
    out = copy.deepcopy(expected)
    for name, case in out.items():
        hashes = kv_hashes(case)
        case["kv_sha256"] = hashes + [got[name]["kv_sha256"]] if got[name]["kv_sha256"] not in hashes else hashes
        if "kv_stats" in got[name]:
            case.setdefault("kv_stats", got[name]["kv_stats"])
    return out


def fixture_path(model) -> Path:
    return Path(model.path) / FIXTURE_NAME


SAMPLE_BYTES = 1 << 20  # of each safetensors file's data, from its start and its end


def model_identity(model_dir) -> str:
    """Which weights a fixture pins: sha256 over config.json and the weights' description (a pack's manifest, which
    holds every record's sha256; or each safetensors file's header and the first and last MiB of its data). A
    quantized pack of a checkpoint, or another checkpoint of the same shapes, gets another identity; reading it
    costs a few MiB whatever the model's size."""
    from .quant.pack import MANIFEST

    root = Path(model_dir)
    h = hashlib.sha256()
    for name in ("config.json", MANIFEST):
        if (root / name).is_file():
            h.update(name.encode() + b"\0" + (root / name).read_bytes())
    if not (root / MANIFEST).is_file():
        for f in sorted(root.glob("*.safetensors")):
            with open(f, "rb") as fh:
                size = f.stat().st_size
                h.update(f.name.encode() + b"\0" + fh.read(SAMPLE_BYTES))
                fh.seek(max(0, size - SAMPLE_BYTES))
                h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()


def load_fixture(path: Path, model_dir=None) -> dict:
    """The fixture's cases. With model_dir, a fixture blessed on other weights (its `model` identity differs) is
    refused with a one-line CheckpointError instead of failing every case."""
    from .errors import CheckpointError

    try:
        data = json.loads(Path(path).read_text())
        cases = data["cases"]
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no golden fixture; run `diffgemma golden --bless` to create it") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: malformed golden fixture ({e})") from None
    pinned = data.get("model")
    if model_dir is not None and pinned is not None and pinned != model_identity(model_dir):
        raise CheckpointError(f"{path}: this fixture pins another model's outputs (blessed on weights "
                              f"{pinned[:12]}, these are {model_identity(model_dir)[:12]}: another checkpoint, or a "
                              f"quantized pack of it); run `diffgemma golden --model {model_dir} --bless` to pin "
                              f"this model's")
    return cases


def bless(results: dict, path: Path, model_dir=None) -> None:
    """Write the fixture atomically (temp file + rename): a failed bless leaves the old one intact. With model_dir,
    the fixture records the model's identity (model_identity), which load_fixture checks."""
    path = Path(path)
    data = {"version": 1, "cases": results}
    if model_dir is not None:
        data["model"] = model_identity(model_dir)
    payload = json.dumps(data, indent=1, sort_keys=True) + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".golden-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
