#!/usr/bin/env bash
# Held-out clean bundles judged on the CPU under the shipped rules: the false-alarm count of
# docs/validation.md "Held-out clean bundles: the count". Every stage appends to
# OUT/STAGE/records.jsonl (a rerun runs only what is not recorded there), then the table is printed:
#   trained   tiny-trained seeds 1400-1416 x b300-tp8 (NVFP4), gb300-dep16 (MXFP4 pass-through),
#             mi355x-tp8 (FP8): 51 bundles
#   layouts   tiny-trained seeds 1400-1405 and tiny 1403-1405 x b200-tp8-pp2 (pipeline stages) and
#             h200-tp16-ep16 (TP 16): 18 bundles
#   random    tiny seeds 1403-1410 x the three storage formats' layouts: 24 bundles
#   small     small seeds 1400-1401 x the three: 6 bundles
#   fullwidth full-width seed 1400 x b300-tp8 (release widths, 4 layers): greedy (4 steps), thinking
#             (2 steps) and the long case (2 steps) at FW_LONG_TOKENS (default 256)
# The long-context case runs at LONG_TOKENS (default 1024; the 8,192-token bundles are
# tolerances/calibration/clean-2026-12-07-cpu-long8192.jsonl.gz). Full depth: bench/full_depth_seeds.sh.
# Usage: OUT=/tmp/clean WORKERS=2 PYTHON=.venv/bin/python bash bench/clean_bundles.sh [STAGE ...] (default: every stage)
set -eu
OUT=${OUT:-/tmp/clean}; W=${WORKERS:-2}; LT=${LONG_TOKENS:-1024}; PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
run() { local stage=$1; shift; "$PY" -u bench/calibrate.py run --threads 1 --device cpu --no-faults \
          --out "$OUT/$stage" "$@"; }
three="--layout b300-tp8 --layout gb300-dep16 --layout mi355x-tp8"
for stage in ${*:-trained layouts random small fullwidth}; do
  case "$stage" in
  trained) run trained --workers "$W" --long-tokens "$LT" --preset tiny-trained:1400-1416 $three ;;
  layouts) run layouts --workers "$W" --long-tokens "$LT" --preset tiny-trained:1400-1405 --preset tiny:1403-1405 \
             --layout b200-tp8-pp2 --layout h200-tp16-ep16 ;;
  random) run random --workers "$W" --long-tokens "$LT" --preset tiny:1403-1410 $three ;;
  small) run small --workers 1 --long-tokens "$LT" --preset small:1400-1401 $three ;;
  fullwidth)  # fewer decode steps: a CPU decode step re-reads each layer's weights at release width
    mkdir -p "$OUT/fullwidth-cases"
    sed 's/steps: 16/steps: 4/' golden/cases/greedy.yaml > "$OUT/fullwidth-cases/greedy.yaml"
    sed 's/steps: 16/steps: 2/' golden/cases/thinking.yaml > "$OUT/fullwidth-cases/thinking.yaml"
    sed 's/steps: 8/steps: 2/' golden/cases/long_context.yaml > "$OUT/fullwidth-cases/long_context.yaml"
    OMP_NUM_THREADS=2 "$PY" -m k3bundle calibrate --faults none --threads 2 --device cpu --workers 1 \
      --out "$OUT/fullwidth" --cases "$OUT/fullwidth-cases" --long-tokens "${FW_LONG_TOKENS:-256}" \
      --preset full-width:1400 --layout b300-tp8 ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
"$PY" bench/calibrate.py count "$OUT"/*/records.jsonl
