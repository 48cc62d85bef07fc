#!/usr/bin/env bash
# Clean full-depth bundles (synth --preset full-depth: 93 layers, the release's 497,220 tensors)
# through golden and validate, several seeds side by side: the false-alarm check of the added
# limits at release depth (docs/validation.md "A clean false alarm at full depth").
#   SEEDS="0 1 2 3 4" CASES="greedy thinking" LAYOUT=b300-tp8 STEPS=2 JOBS=5 bash bench/full_depth_seeds.sh OUT
# Each seed: synth -> convert LAYOUT -> golden (the greedy and thinking cases, STEPS decode steps) ->
# validate --ranks merged --json. Prints one line per seed: exit code, checks, failures, the first
# failure and the worst added NMSE against its (widened) limit; OUT/seed-S.json is the sign-off.
# On the device machine carry [".whl"] (zstandard, fla-core, einops wheels for cp312).
set -u
OUT=${1:?OUT}; SEEDS=${SEEDS:-0 1 2 3 4}; LAYOUT=${LAYOUT:-b300-tp8}; STEPS=${STEPS:-2}; JOBS=${JOBS:-5}
WORK=${WORK:-/tmp/fd}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
else
  export PYTHONPATH=$PWD
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} PYTHONUNBUFFERED=1
K3="python3 -m k3bundle"
mkdir -p "$OUT" "$WORK/cases"
for c in ${CASES:-greedy thinking}; do sed "s/steps: 16/steps: $STEPS/" golden/cases/$c.yaml > "$WORK/cases/$c.yaml"; done
one() {
  local s=$1 d=$WORK/s$1; SECONDS=0; rm -rf "$d"
  { $K3 synth --preset full-depth --seed "$s" --out "$d/ckpt" --force \
    && $K3 convert "$d/ckpt" --target "$LAYOUT" --out "$d/b" \
    && $K3 golden "$d/b" --cases "$WORK/cases" --out "$d/b/validation"; } > "$OUT/seed-$s.log" 2>&1 \
    || { echo "seed $s: setup failed after ${SECONDS}s (see seed-$s.log)"; return; }
  $K3 validate "$d/b" --ranks merged --json > "$OUT/seed-$s.json" 2>> "$OUT/seed-$s.log"
  local rc=$?
  python3 - "$OUT/seed-$s.json" "$s" "$rc" "$SECONDS" <<'PY'
import json, sys
path, seed, rc, secs = sys.argv[1:]
try:
    d = json.load(open(path))
except Exception as e:
    print(f"seed {seed}: exit {rc}, no report ({e})"); sys.exit()
checks = sum(c.get("checks", 0) for c in d["cases"]); failed = sum(c.get("failed", 0) for c in d["cases"])
worst = max(((r["values"]["nmse"] / r["limits"]["nmse"], r["tap"], r["values"]["nmse"], r["limits"]["nmse"])
             for c in d["cases"] for r in c.get("results", [])
             if r["mode"] == "added" and isinstance(r["values"].get("nmse"), float) and "nmse" in r["limits"]),
            default=None)
ff = [c["first_failure"]["line"] for c in d["cases"] if c.get("first_failure")]
print(f"seed {seed}: exit {rc}, {failed}/{checks} checks failed, {secs}s; worst added NMSE use "
      + (f"{worst[0]:.2f} at {worst[1]} ({worst[2]:.2e} / {worst[3]:.2e})" if worst else "-")
      + (f"; first failure: {ff[0]}" if ff else ""))
PY
}
for s in $SEEDS; do
  one "$s" &
  while [ "$(jobs -r | wc -l)" -ge "$JOBS" ]; do sleep 2; done
done
wait
