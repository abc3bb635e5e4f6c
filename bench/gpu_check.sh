#!/bin/bash
# GPU check of a change against a base commit, in one device call: the engine's GPU tests on the new tree, and
# bench_engine's and bench_pack's step (and generate's tokens) on both trees, in the same process order each.
#
#   bash NEW/bench/gpu_check.sh OLD NEW OUT [BUDGET_S]
#
# OLD and NEW are checkouts (e.g. `git archive` of each commit); DEST gets summary.md (the table, also printed last)
# and logs.tgz (every log and JSON: the device tool brings back few files). BUDGET_S (default 550) caps the whole
# run: the last test phase gets what is left. A phase past its time gets SIGINT, so pytest still prints its summary.
set -u
OLD=$(cd "$1" && pwd); NEW=$(cd "$2" && pwd); DEST=$(mkdir -p "$3" && cd "$3" && pwd); BUDGET=${4:-550}
OUT=$(mktemp -d)
export PYTHONUNBUFFERED=1
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"

# 1. the tests that exercise graphs, guarded graphs, staging and the run-ahead (CPU tests cannot)
(cd "$NEW" && PYTHONPATH=src timeout -s INT -k 10 150 python3 -m pytest -q -rfEs -p no:cacheprovider --timeout=100 \
    tests/gpu/test_engine_gpu.py tests/gpu/test_generate_gpu.py \
    > "$OUT/tests_engine.log" 2>&1; echo "rc=$?" >> "$OUT/tests_engine.log")
tail -4 "$OUT/tests_engine.log"

# 2. the step, old and new: bf16 (bench_engine, with generate's tokens) and q4 (bench_pack's engine section)
ENGINE_ARGS="--contexts 1024 --skip-hf --ab= --reps 20"
PACK_ARGS="--skip kernels,gather,bf16,floor,launch_order,q4_inputs,glu,layouts --reps 20"
(cd "$OLD" && PYTHONPATH=src timeout 100 python3 bench/bench_engine.py $ENGINE_ARGS --json "$OUT/engine_old.json" \
    > "$OUT/engine_old.log" 2>&1)
(cd "$NEW" && PYTHONPATH=src timeout 100 python3 -m bench.bench_engine $ENGINE_ARGS --json "$OUT/engine_new.json" \
    > "$OUT/engine_new.log" 2>&1)
(cd "$OLD" && PYTHONPATH=src timeout 90 python3 bench/bench_pack.py $PACK_ARGS --json "$OUT/pack_old.json" \
    > "$OUT/pack_old.log" 2>&1)
(cd "$NEW" && PYTHONPATH=src timeout 90 python3 -m bench.bench_pack $PACK_ARGS --json "$OUT/pack_new.json" \
    > "$OUT/pack_new.log" 2>&1)

# 3. the rest of tests/gpu with what is left
REST=$(( $(left) - 15 ))
if [ "$REST" -gt 20 ]; then
  (cd "$NEW" && PYTHONPATH=src timeout -s INT -k 10 "$REST" python3 -m pytest -q -rfEs -p no:cacheprovider --timeout=120 tests/gpu \
      --ignore=tests/gpu/test_engine_gpu.py --ignore=tests/gpu/test_generate_gpu.py > "$OUT/tests_rest.log" 2>&1; echo "rc=$?" >> "$OUT/tests_rest.log")
else
  echo "no time left for the other GPU tests" > "$OUT/tests_rest.log"
fi

python3 - "$OUT" <<'EOF'
import json, re, sys
from pathlib import Path

out = Path(sys.argv[1])


def load(name):
    try:
        return json.loads((out / name).read_text())
    except Exception as e:
        return {"error": str(e)}


def tail_line(name):
    try:
        lines = [l for l in (out / name).read_text().splitlines() if re.search(r"passed|failed|error|rc=", l)]
        return " / ".join(lines[-2:])
    except Exception as e:
        return str(e)


rows = ["| metric | old | new |", "|---|---|---|"]
eo, en = (load(f"engine_{w}.json").get("ours", {}) for w in ("old", "new"))
for key in ("denoise_ms", "denoise_embeds_ms", "denoise_embeds_unstaged_ms", "denoise_eager_ms", "prefill_tok_s"):
    rows.append(f"| bf16 1k {key} | {eo.get('ctx', {}).get('1024', {}).get(key)} | {en.get('ctx', {}).get('1024', {}).get(key)} |")
for key in ("step_ms", "outside_ms_per_step", "forwards", "tokens", "tokens_hash", "status_reads_per_step", "error"):
    rows.append(f"| bf16 generate {key} | {eo.get('generate', {}).get(key)} | {en.get('generate', {}).get(key)} |")
po, pn = (load(f"pack_{w}.json").get("engine_q4", {}) for w in ("old", "new"))
for key in ("denoise_1k_ms", "denoise_1k_embeds_ms", "prefill_8k_dequant_tok_s", "mem_8k_allocated_gib"):
    rows.append(f"| q4 {key} | {po.get(key)} | {pn.get(key)} |")
for key in ("tokens", "forwards", "peak_allocated_gib"):
    rows.append(f"| q4 session_8k {key} | {po.get('session_8k', {}).get(key)} | {pn.get('session_8k', {}).get(key)} |")
rows.append(f"| tests (engine, generate) | | {tail_line('tests_engine.log')} |")
rows.append(f"| tests (the rest of tests/gpu) | | {tail_line('tests_rest.log')} |")
table = "\n".join(rows)
(out / "summary.md").write_text(table + "\n")
print(table)
EOF
cp "$OUT/summary.md" "$DEST/summary.md"
tar -czf "$DEST/logs.tgz" -C "$OUT" .
