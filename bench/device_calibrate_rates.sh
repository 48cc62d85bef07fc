#!/usr/bin/env bash
# One device-machine call (16 cores + one H200) measuring bench/calibrate.py's rates under the
# shipped rules. PART=clean: held-out clean bundles, CPU (12 workers) and CUDA (4 workers).
# PART=faults: calibration seeds 3-4 clean + faulted (CPU), held-out faulted bundles (CPU, CUDA).
# Usage: PART=clean|faults CAL_SECONDS=540 bash bench/device_calibrate_rates.sh OUT
set -u
OUT=${1:?OUT}; PART=${PART:?PART=clean or faults}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/zstandard*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
alt() { for s in $(seq $1 $2); do echo "--preset tiny:$s --preset tiny-trained:$s"; done; }
L3="--layout b300-tp8 --layout gb300-dep16 --layout mi355x-tp8"
L2="--layout b300-tp8 --layout gb300-dep16"
C="python3 bench/calibrate.py run --threads 1 --long-tokens 256"
W=/tmp/cal; mkdir -p $W; T=${CAL_SECONDS:-540}
if [ "$PART" = clean ]; then
  timeout $T $C --out $W/cpu --device cpu --workers 12 --no-faults $(alt 500 519) $L3 > $OUT/cpu.log 2>&1 &
  timeout $T $C --out $W/cuda --device cuda --workers 4 --no-faults $(alt 600 619) $L2 > $OUT/cuda.log 2>&1 &
else
  timeout $T $C --out $W/cpu --device cpu --workers 6 $(alt 3 4) $L3 > $OUT/cpu.log 2>&1 &
  timeout $T $C --out $W/cpuf --device cpu --workers 6 --faults-only $(alt 500 501) $L3 > $OUT/cpuf.log 2>&1 &
  timeout $T $C --out $W/cuda --device cuda --workers 4 --faults-only $(alt 600 601) $L2 > $OUT/cuda.log 2>&1 &
fi
wait
for d in $W/*/; do n=$(basename $d); gzip -c $d/records.jsonl > $OUT/$PART-$n.jsonl.gz; tail -1 $OUT/$n.log; done
ls -la $OUT
