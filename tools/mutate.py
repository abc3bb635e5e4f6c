"""Mutation testing on demand (not in CI): plant one-line bugs, one at a time, and check that the tests catch each.

Each mutant names a code snippet (matched as text, not by line number, so the list survives code moving within or
between files), its replacement, and the few test files / -k selections that should kill it. The script copies the
working tree (tracked and untracked files that git does not ignore) to a temporary directory once, then for each
mutant: writes the mutated file into the copy, runs the mutant's tests there with a timeout, and restores the file.
The checkout itself is never modified. A snippet that is not found exactly once, in its file or (if the file moved)
anywhere under src/, is reported as STALE rather than guessed at.

    python tools/mutate.py                   # every mutant; writes docs/MUTATION.md
    python tools/mutate.py --only acc-le-lt flash-out-scale --out /tmp/m.md
    python tools/mutate.py --list

Outcomes: KILLED (the tests failed), SURVIVED (they passed: a missing test, or an equivalent mutant that the
`note` explains), TIMEOUT, STALE (snippet not found), ERROR (pytest could not run the tests: exit code 2-5, which
also counts as caught, e.g. an import that breaks, but is listed separately). The tests run with a fixed
DGTEST_SEED (--seed), so a run is repeatable. On a 2-core machine the whole list takes ~10-15 min of CPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Mutant:
    id: str
    file: str  # where the snippet lives today (searched for under src/ if it moved)
    find: str  # exact text, must occur exactly once in the file
    replace: str
    tests: list[str]  # pytest arguments (paths, -k expressions)
    note: str = ""  # what the bug stands for; for an expected survivor, why it is equivalent
    expect_survive: bool = False
    group: str = "core"  # which audit added it (the report counts each group's kill rate)


S, R, O = "src/diffgemma/sampling/", "src/diffgemma/model/reference.py", "src/diffgemma/ops/"
# Few distinct selections: each is run once unmutated first (the baseline), and -x stops a killed mutant's run at
# its first failure, so a broader selection costs little.
T_SAMPLING = "tests/test_sampling.py"
SAMP = [T_SAMPLING, "tests/test_mutants_sampling.py"]
SYNC = ["tests/test_generate_sync.py", "-k", "device_lcg or temperature_value or device_stop"]
T_REF = ["tests/test_reference_parity.py", "-k", "two_blocks"]
FLASH = ["tests/test_attention_kernels.py"]
GEMM = ["tests/test_attention_gemm.py", "-k", "twin"]
OPS = ["tests/test_ops.py", "-k", "qkv_prep or rope or norm or gelu or expert or moe or rowstats or softcap"]
ENG_F16 = ["tests/test_engine_cpu.py", "-k", "f16"]

MUTANTS = [
    # ------------------------------------------------------------------ planted bugs from issue 39
    Mutant("flash-out-scale", O + "attention_flash.py", "o = acc / l_i[:, None]", "o = acc / l_i[:, None] * 1.004",
           FLASH,
           "issue 39: the flash kernel's output off by 0.4 % (unsplit path)"),
    Mutant("flash-merge-scale", O + "attention_flash.py", "o = num / den[:, None]", "o = num / den[:, None] * 1.004",
           FLASH,
           "the split-KV merge's output off by 0.4 %"),
    Mutant("kv-bf16-default", "src/diffgemma/model/engine.py", "kv_dtype=torch.float16, generation_config=None",
           "kv_dtype=torch.bfloat16, generation_config=None", ENG_F16,
           "issue 39: a bf16 KV cache where the contract says f16"),
    Mutant("kv-through-bf16", O + "rope_kv.py", "cache[:, slots[keep]] = out[keep].transpose(0, 1).to(cache.dtype)",
           "cache[:, slots[keep]] = out[keep].transpose(0, 1).to(torch.bfloat16).to(cache.dtype)",
           ENG_F16,
           "issue 39: K/V rounded through bf16 on their way into an f16 cache (the torch twin's cache write)"),
    Mutant("qkv-v-slot-unmasked", O + "qkv.py", "mv = ((kind == 2) & written)[:, None] & full",
           "mv = ((kind == 2) & j_ok)[:, None] & full", OPS,
           "issue 39: the qkv kernel writes V for tokens with slot -1 (into slot 0)"),
    # ------------------------------------------------------------------ sampling/
    Mutant("accept-le-lt", S + "accept.py", "sorted_ok = before <= bound", "sorted_ok = before < bound",
           SAMP, "accept while the prefix sum is strictly below the bound"),
    Mutant("accept-inclusive-sum", S + "accept.py", "before = torch.cumsum(sorted_h, dim=-1) - sorted_h",
           "before = torch.cumsum(sorted_h, dim=-1)", SAMP,
           "the prefix sum includes the position itself"),
    Mutant("accept-final-step-all", S + "accept.py",
           "return frozen.clone() if frozen is not None else torch.zeros_like(entropy, dtype=torch.bool)",
           "return frozen.clone() if frozen is not None else torch.ones_like(entropy, dtype=torch.bool)",
           SAMP, "the final step accepts everything (test_sampling.py kills it; tests/test_mutants_sampling.py pins it too)"),
    Mutant("accept-freeze-dropped", S + "accept.py",
           "return frozen | _sorted_prefix(entropy.masked_fill(frozen, float(\"inf\")), bound, stable=True)",
           "return _sorted_prefix(entropy.masked_fill(frozen, float(\"inf\")), bound, stable=True)",
           SAMP, "the legacy freeze forgets the frozen positions"),
    Mutant("temp-cur-minus-one", S + "schedule.py",
           "return t_min + (t_max - t_min) * (torch.tensor(cur, dtype=torch.int32) / max_steps)",
           "return t_min + (t_max - t_min) * (torch.tensor(cur - 1, dtype=torch.int32) / max_steps)",
           SAMP, "the schedule one step late"),
    Mutant("remaining-off-by-one", S + "schedule.py", "return max_steps - step + 1", "return max_steps - step",
           SAMP,
           "step -> steps remaining off by one"),
    Mutant("temp-value-f64", S + "schedule.py", "frac = np.float32(cur) / np.float32(max_steps)",
           "frac = np.float64(cur) / np.float64(max_steps)", SYNC,
           "the host temperature in f64: no longer the bits of transformers' f32 one"),
    Mutant("lcg-seed-plus-one", S + "rng.py", "self.state = (int(seed) + 1) & _MASK64",
           "self.state = int(seed) & _MASK64", SAMP, "the contract's seed + 1 start"),
    Mutant("lcg-high-bits", S + "rng.py", "return states >> np.uint64(32)", "return states >> np.uint64(31)",
           SAMP, "the vectorised draw takes the wrong bits"),
    Mutant("lcg-randint-mod", S + "rng.py", "ids = (self.u32(n) * np.uint64(high)) >> np.uint64(32)",
           "ids = self.u32(n) % np.uint64(high)", SAMP,
           "ids by modulo instead of the contract's high-bits scaling"),
    Mutant("device-lcg-sign", S + "rng.py", "return (states >> 32) & 0xFFFFFFFF", "return states >> 32",
           SYNC,
           "the device LCG's draws keep the int64 sign (negative draws)"),
    Mutant("block-seed-collide", S + "rng.py", "0xD1B54A32D192ED03 * attempt", "0x9E3779B97F4A7C15 * attempt",
           SAMP, "re-roll streams collide with the next block's"),
    Mutant("categorical-left", S + "rng.py", "idx = torch.searchsorted(cdf, target[:, None], right=True)",
           "idx = torch.searchsorted(cdf, target[:, None], right=False)", SAMP,
           "inverse CDF picks the token whose cumulative probability equals u (a zero-probability one at u = 0) (survived test_sampling.py alone; killed by tests/test_mutants_sampling.py, added for it)"),
    Mutant("sc-exact-no-scale", S + "self_condition.py",
           "return (probs @ embedding) * torch.tensor(scale, dtype=torch.float32).to(embedding.dtype)",
           "return probs @ embedding", SAMP, "exact SC forgets sqrt(hidden)"),
    Mutant("sc-sparse-unnormalised", S + "self_condition.py", "weights = torch.exp(logits[rows, cols] - log_z[rows])",
           "weights = torch.exp(logits[rows, cols] - logits.max(dim=-1).values[rows])", SAMP,
           "sparse SC weights relative to the row max instead of probabilities"),
    Mutant("sc-bound-mean", S + "self_condition.py",
           "return float(tail.max()) * scale * float(embedding.abs().max())",
           "return float(tail.mean()) * scale * float(embedding.abs().max())", SAMP,
           "the stated error bound from the mean tail mass instead of the worst row (survived test_sampling.py alone; killed by tests/test_mutants_sampling.py, added for it)"),
    Mutant("entropy-no-clamp", S + "stats.py", "logp = logp.clamp(min=torch.finfo(logp.dtype).min)", "pass",
           SAMP, "entropy of a row with -inf logits becomes NaN (survived test_sampling.py alone; killed by tests/test_mutants_sampling.py, added for it)"),
    Mutant("entropy-mean", S + "stats.py", "return -(logp * probs).sum(dim=-1)", "return -(logp * probs).mean(dim=-1)",
           SAMP, "entropy divided by the vocabulary size"),
    Mutant("max-prob-unnormalised", S + "stats.py",
           "return torch.exp(logits.max(dim=-1).values - logits.logsumexp(dim=-1))",
           "return torch.exp(logits.max(dim=-1).values)", SAMP,
           "p_max without the normaliser"),
    Mutant("trim-row-zero", S + "trim.py", "for i in range(1, min(answer_len, len(ids))):",
           "for i in range(0, min(answer_len, len(ids))):", SAMP, "the trim may cut row 0 (test_sampling.py kills it; tests/test_mutants_sampling.py pins it too)"),
    Mutant("trim-right-neighbour", S + "trim.py",
           "(ids[i] == ids[i - 1] or (i + 1 < len(ids) and ids[i] == ids[i + 1]))", "(ids[i] == ids[i - 1])",
           SAMP, "the trim ignores a copy of the right neighbour (test_sampling.py kills it; tests/test_mutants_sampling.py pins it too)"),
    Mutant("stop-max-steps", S + "stops.py", "        if step >= self.max_steps:\n            return MAX_STEPS",
           "        if step > self.max_steps:\n            return MAX_STEPS", SAMP,
           "one step past max_steps"),
    Mutant("stop-device-max-steps", S + "stops.py",
           "code = torch.full((), 4 if step >= self.max_steps else 0", "code = torch.full((), 4 if step > self.max_steps else 0",
           SYNC,
           "the device stop rules one step past max_steps"),
    Mutant("confident-le", S + "stops.py", "if stable and mean_entropy < self.confidence_threshold:",
           "if stable and mean_entropy <= self.confidence_threshold:", SAMP,
           "confidence threshold inclusive (survived test_sampling.py alone; killed by tests/test_mutants_sampling.py, added for it)"),
    # ------------------------------------------------------------------ the reference forward
    Mutant("ref-norm-one-plus-w", R, "return y if weight is None else y * weight",
           "return y if weight is None else y * (1 + weight)", T_REF, "RMSNorm as x·(1+w) (the other Gemma)"),
    Mutant("ref-norm-sum", R, "y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)",
           "y = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)", T_REF, "RMSNorm over the sum, not the mean"),
    Mutant("ref-rope-direction", R, "return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)",
           "return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)", T_REF, "RoPE rotates backwards"),
    Mutant("ref-rope-partial-exps", R, "exps = torch.arange(0, 2 * angles, 2, dtype=dtype) / hd",
           "exps = torch.arange(0, 2 * angles, 2, dtype=dtype) / (2 * angles)", T_REF,
           "partial RoPE's exponents over the rotated dims instead of the whole head_dim"),
    Mutant("ref-attn-scale", R, "scores = torch.einsum(\"qhd,khd->hqk\", q, k)",
           "scores = torch.einsum(\"qhd,khd->hqk\", q, k) / q.shape[-1] ** 0.5", T_REF,
           "a 1/sqrt(d) attention scale the checkpoint does not have"),
    Mutant("ref-window-off-by-one", R, "in_window = keys[None, :] > pos[:, None] - self.config.sliding_window",
           "in_window = keys[None, :] >= pos[:, None] - self.config.sliding_window", T_REF,
           "the sliding window one key too wide in prefill"),
    Mutant("ref-route-no-renorm", R, "weights = weights / weights.sum(-1, keepdim=True)", "weights = weights", T_REF,
           "top-k router weights not renormalised"),
    Mutant("ref-route-no-hscale", R, "h = rms_norm(x, None, eps) * scale * (x.shape[-1] ** -0.5)",
           "h = rms_norm(x, None, eps) * scale", T_REF, "router input without H^-0.5"),
    Mutant("ref-no-softcap", R, "return cap * torch.tanh(logits / cap)", "return logits", T_REF,
           "final logit softcap dropped"),
    Mutant("ref-scalar-encoder-always", R,
           "scalar = f\"{DECODER}layers.{layer.index}.layer_scalar\" if denoise else",
           "scalar = f\"{ENCODER_LAYERS}{layer.index}.layer_scalar\" if denoise else", T_REF,
           "denoise uses the encoder's layer_scalar"),
    Mutant("ref-denoise-input-no-norm", R, "return rms_norm(x, None, cfg.rms_norm_eps)", "return x", T_REF,
           "denoise input without its no-scale norm"),
    Mutant("ref-v-no-norm", R, "v = rms_norm(v_raw, None, eps)", "v = v_raw", T_REF, "V without its no-scale norm"),
    Mutant("ref-prefill-last-ffn", R, "with_ffn=layer.index != last)", "with_ffn=True)", T_REF,
           "EQUIVALENT: prefill's last layer keeps only K/V, which come before its FFN; the FFN's output is never "
           "read, so running it changes no number (the condition only saves work)", expect_survive=True),
    # ------------------------------------------------------------------ the kernels' torch twins (ops/)
    Mutant("twin-rope-direction", O + "rope_kv.py", "y = torch.cat((y1 * cos - y2 * sin, y2 * cos + y1 * sin), dim=-1)",
           "y = torch.cat((y1 * cos + y2 * sin, y2 * cos - y1 * sin), dim=-1)",
           OPS, "the norm+RoPE twin rotates backwards"),
    Mutant("twin-attn-v-mask", O + "attention.py",
           "vf = v[:, :n_keys].float().masked_fill((kpos[:n_keys] < 0)[None, :, None], 0.0)",
           "vf = v[:, :n_keys].float()", FLASH,
           "the attention twin reads masked V rows (0 · NaN)"),
    Mutant("twin-attn-window", O + "attention.py", "return (kp >= 0) & (kp <= qp) & (kp > qp - window)",
           "return (kp >= 0) & (kp <= qp) & (kp >= qp - window)",
           FLASH, "the twin's causal window one key too wide"),
    Mutant("twin-rms-one-plus-w", O + "rmsnorm.py", "    if w is not None:\n        y = y * w.float()",
           "    if w is not None:\n        y = y * (1 + w.float())", OPS,
           "the RMSNorm twin as x·(1+w)"),
    Mutant("twin-layer-finish-scalar", O + "rmsnorm.py",
           "return ((res.float() + _norm_f32(s, eps) * w3.float()) * scalar).to(res.dtype)",
           "return (res.float() + _norm_f32(s, eps) * w3.float()).to(res.dtype)", OPS,
           "the layer-finish twin drops layer_scalar"),
    Mutant("twin-gelu-erf", O + "gelu_mul.py", "y = F.gelu(gu[..., :f].float(), approximate=\"tanh\") * gu[..., f:].float()",
           "y = F.gelu(gu[..., :f].float()) * gu[..., f:].float()", OPS,
           "the gated GELU twin uses erf GELU instead of the checkpoint's tanh approximation"),
    Mutant("twin-experts-weight", O + "moe.py", "out.index_add_(0, tok, y.float() * weights[tok, slot, None])",
           "out.index_add_(0, tok, y.float())", OPS,
           "the experts twin ignores the router weights"),
    Mutant("twin-rowstats-entropy", O + "softcap.py", "entropy = lse - (p * z).sum(-1)", "entropy = lse + (p * z).sum(-1)",
           OPS, "the row-stats twin's entropy sign (killed by the twin-entropy check added to test_softcap_rowstats for it)"),
    Mutant("twin-softcap", O + "softcap.py", "return torch.tanh(raw.float() / cap) * cap", "return torch.tanh(raw.float())",
           OPS, "the softcap twin without the cap"),
    Mutant("twin-chunk-softmax-p", O + "attention_gemm.py", "p[..., c * chunk:(c + 1) * chunk] = e.to(p_dtype)",
           "p[..., c * chunk:(c + 1) * chunk] = (e * 1.004).to(p_dtype)", GEMM,
           "the GEMM attention's chunk softmax twin writes P 0.4 % high (its l unchanged)"),
    Mutant("twin-chunk-softmax-shift", O + "attention_gemm.py", "e = torch.exp2(xc - m[..., None])",
           "e = torch.exp2(xc - m[..., None] + 0.006)", GEMM,
           "P and l of every chunk scaled by the same 2^0.006: the merged output cannot see it (P·V / l cancels), "
           "the kernel-vs-twin comparison of P itself does"),
]

# issue 55's mutants live in their own list (tools/mutants_hardening.py)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutants_hardening import NEW as _ISSUE55  # noqa: E402

MUTANTS += [Mutant(*entry, group="issue55") for entry in _ISSUE55]


def run(cmd, cwd, env, timeout):
    """-> (status, returncode, seconds, tail of the output). Kills the whole process group on timeout."""
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return "TIMEOUT", None, time.time() - t0, out[-2000:]
    except BaseException:  # interrupted (Ctrl-C, SIGTERM): take the test run down with us
        os.killpg(p.pid, signal.SIGKILL)
        raise
    status = {0: "SURVIVED", 1: "KILLED"}.get(p.returncode, "ERROR")
    return status, p.returncode, time.time() - t0, out[-2000:]


def copy_tree(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)


def locate(tree: Path, m: Mutant) -> tuple[Path | None, str]:
    """The file holding m.find exactly once: its named file, else the one file under src/ that has it."""
    named = tree / m.file
    if named.is_file() and named.read_text().count(m.find) == 1:
        return named, m.file
    hits = [p for p in (tree / "src").rglob("*.py") if m.find in p.read_text()]
    if len(hits) == 1 and hits[0].read_text().count(m.find) == 1:
        return hits[0], str(hits[0].relative_to(tree))
    return None, f"{m.file}: snippet found {len(hits)} file(s) / not exactly once"


def git_state() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    subject = subprocess.run(["git", "log", "-1", "--format=%s"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "src", "tests"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()  # what the outcomes depend on
    return f"`{head}` ({subject[:70]}){' with uncommitted changes in src/ or tests/' if dirty else ''}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="mutant ids to run (default: all)")
    ap.add_argument("--group", default=None, help="run only this group's mutants (core, issue55)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "MUTATION.md"), help="the markdown report")
    ap.add_argument("--timeout", type=int, default=400, help="seconds per mutant's test run (wall clock)")
    ap.add_argument("--seed", default="39", help="DGTEST_SEED for every run")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the selected tests")
    ap.add_argument("--merge", action="store_true",
                    help="with --only or --group: keep the other mutants' outcomes from the existing --out report")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the copy is deleted, the test run killed
    mutants = [m for m in MUTANTS if (not args.only or m.id in args.only) and args.group in (None, m.group)]
    if args.list:
        for m in mutants:
            print(f"{m.id:28s} {m.file}  ->  {' '.join(m.tests)}")
        return 0
    assert len({m.id for m in MUTANTS}) == len(MUTANTS), "duplicate mutant ids"
    state, started = git_state(), datetime.datetime.now(datetime.timezone.utc)
    rows, survivors = [], []
    with tempfile.TemporaryDirectory(prefix="diffgemma-mutate-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        env = dict(os.environ, PYTHONPATH=str(tree / "src"), DGTEST_SEED=args.seed, TRITON_INTERPRET="1",
                   PYTHONDONTWRITEBYTECODE="1")
        pytest = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--no-header", "-W", "ignore"]
        if not args.no_baseline:  # every selection must pass unmutated, or its verdicts mean nothing
            for sel in sorted({tuple(m.tests) for m in mutants}):
                status, rc, secs, out = run(pytest + list(sel), tree, env, args.timeout)
                print(f"baseline {' '.join(sel)}: {'ok' if rc == 0 else status} ({secs:.0f}s)", flush=True)
                if rc != 0:
                    print(out)
                    return 2
        for m in mutants:
            path, where = locate(tree, m)
            if path is None:
                rows.append((m, "STALE", 0.0, where))
                print(f"{m.id}: STALE ({where})", flush=True)
                continue
            original = path.read_text()
            path.write_text(original.replace(m.find, m.replace))
            try:
                status, rc, secs, out = run(pytest + m.tests, tree, env, args.timeout)
            finally:
                path.write_text(original)
            rows.append((m, status, secs, where))
            if status == "SURVIVED":
                survivors.append(m)
            print(f"{m.id}: {status} ({secs:.0f}s)", flush=True)
    runs = [f"Ran on {state}, {started:%Y-%m-%d %H:%M} UTC, DGTEST_SEED={args.seed}"
            + (f": {', '.join(m.id for m in mutants)}." if args.only else
               f": the {args.group} group." if args.group else ".")]
    if args.merge and (args.only or args.group) and Path(args.out).exists():  # the other mutants' outcomes from the last report
        previous, earlier_runs = read_report(Path(args.out))
        fresh = {m.id: (m, st, secs, where) for m, st, secs, where in rows}
        rows = [fresh.get(m.id) or (m, *previous[m.id]) for m in MUTANTS if m.id in fresh or m.id in previous]
        survivors = [m for m, st, _, _ in rows if st == "SURVIVED"]
        runs = earlier_runs + runs
    history = read_history(Path(args.out)) if Path(args.out).exists() else []
    write_report(Path(args.out), rows, survivors, runs, history)
    print(f"wrote {args.out}")
    unexplained = [m for m in survivors if not m.expect_survive]
    return 1 if unexplained or any(s in ("STALE", "TIMEOUT") for _, s, _, _ in rows) else 0


def read_report(path: Path):
    """-> ({mutant id: (outcome, seconds, file)}, the report's "Ran on" lines)."""
    outcomes, runs = {}, []
    for line in path.read_text().splitlines():
        if line.startswith("Ran on "):
            runs.append(line)
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`") and cells[3].isupper():
            outcomes[cells[0].strip("`")] = (cells[3], float(cells[4]), cells[1])
    return outcomes, runs


def read_history(path: Path) -> list[str]:
    """The report's hand-written "## History" section (what earlier runs found and what was done), kept as is."""
    lines = path.read_text().splitlines()
    if "## History" not in lines:
        return []
    start = lines.index("## History")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def group_lines(rows) -> list[str]:
    """One kill-rate line per group (killed counts ERROR too: the tests did not pass)."""
    out = []
    for group in dict.fromkeys(m.group for m, _, _, _ in rows):
        mine = [st for m, st, _, _ in rows if m.group == group]
        caught = sum(st in ("KILLED", "ERROR", "TIMEOUT") for st in mine)
        equivalent = sum(1 for m, st, _, _ in rows if m.group == group and st == "SURVIVED" and m.expect_survive)
        out.append(f"- {group}: {caught} of {len(mine)} caught ({100 * caught / len(mine):.0f}%)"
                   + (f", {equivalent} equivalent survivor(s)" if equivalent else ""))
    return out + [""]


def write_report(out: Path, rows, survivors, runs, history=()) -> None:
    counts = {}
    for _, status, _, _ in rows:
        counts[status] = counts.get(status, 0) + 1
    lines = [
        "# Mutation testing",
        "",
        "One-line bugs planted one at a time in a copy of the tree by `tools/mutate.py`, each run against a few",
        "targeted test files (not the whole suite). Re-run on demand: `python tools/mutate.py` (about 10-15 min of",
        "CPU on 2 cores; `--only ID... --merge` re-runs a few and keeps the rest of this report). Not part of CI.",
        "",
        *[r for run in runs for r in (run, "")],
        "Result: " + ", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items())) + f" of {len(rows)} mutants.",
        "",
        *group_lines(rows),
        "| mutant | file | tests | outcome | s |",
        "|---|---|---|---|---|",
    ]
    for m, status, secs, where in rows:
        lines.append(f"| `{m.id}` | {where} | `{' '.join(m.tests)}` | {status} | {secs:.0f} |")
    lines += ["", "## Survivors", ""]
    if not survivors:
        lines.append("None.")
    for m in survivors:
        lines += [f"- `{m.id}` ({m.file}): `{m.find.strip()}` -> `{m.replace.strip()}`. "
                  + (m.note if m.expect_survive else f"UNEXPLAINED: {m.note}")]
    if history:
        lines += ["", *history]
    lines += ["", "## What each mutant stands for", ""]
    lines += [f"- `{m.id}`: {m.note}" for m, _, _, _ in rows]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
