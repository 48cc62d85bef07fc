#!/usr/bin/env bash
# One device-machine call (16 cores + one H200) measuring bench/calibrate.py's rates under the
# shipped rules. PART=clean: held-out clean bundles, CPU (12 workers) and CUDA (4 workers).
# PART=faults: calibration seeds 3-4 clean + faulted (CPU), held-out faulted bundles (CPU, CUDA).
# PART=exact: the exact check on CUDA — clean bundles with CPU goldens (calibration seeds 0-2 set
# the exact_gpu limits, held-out 700+ measure false alarms), every fault on held-out b300-tp8
# bundles, and the small preset (goldens on the GPU: a small job's CPU goldens take ~20 min on
# one core), clean and faulted; plus the exact check's GPU test. PART=exact2: held-out clean bundles
# with the exact check on, CPU (800+) and CUDA with goldens made on the GPU (900+); the two faults
# only the exact check sees, on held-out CPU bundles (560). PART=added: the added limits widened with
# the goldens' own teacher-forced BF16 noise (noise.added_factor) — every fault on held-out bundles
# (CPU 1000+, CUDA 1040+) and held-out clean bundles (CPU 1100+, CUDA 1140+).
# Usage: PART=clean|faults|exact|exact2|exact3|added CAL_SECONDS=540 bash bench/device_calibrate_rates.sh OUT
set -u
OUT=${1:?OUT}; PART=${PART:?PART=clean, faults or exact}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
alt() { for s in $(seq $1 $2); do echo "--preset tiny:$s --preset tiny-trained:$s"; done; }
L3="--layout b300-tp8 --layout gb300-dep16 --layout mi355x-tp8"
L2="--layout b300-tp8 --layout gb300-dep16"
C="python3 bench/calibrate.py run --threads 1 --long-tokens 256"
W=/tmp/cal-$PART; mkdir -p $W; T=${CAL_SECONDS:-540}
if [ "$PART" = clean ]; then
  timeout $T $C --out $W/cpu --device cpu --workers 12 --no-faults $(alt 500 519) $L3 > $OUT/cpu.log 2>&1 &
  timeout $T $C --out $W/cuda --device cuda --workers 4 --no-faults $(alt 600 619) $L2 > $OUT/cuda.log 2>&1 &
elif [ "$PART" = exact ]; then
  timeout $T $C --out $W/cuda --device cuda --workers 9 --no-faults $(alt 0 2) $(alt 700 709) $L2 > $OUT/cuda.log 2>&1 &
  timeout $T $C --out $W/cudaf --device cuda --workers 4 --faults-only $(alt 740 745) --layout b300-tp8 > $OUT/cudaf.log 2>&1 &
  timeout $T $C --out $W/small --device cuda --golden-device cuda --workers 2 --preset small:700-703 \
    --layout b300-tp8 > $OUT/small.log 2>&1 &
  timeout $T python3 -m pytest -q -x -p no:cacheprovider -k exact_check tests/test_validate_gpu.py > $OUT/pytest-gpu.log 2>&1 &
elif [ "$PART" = exact2 ]; then
  timeout $T $C --out $W/cpu --device cpu --workers 8 --no-faults $(alt 800 812) $L3 > $OUT/cpu.log 2>&1 &
  timeout $T $C --out $W/cpuf --device cpu --workers 2 --faults-only --fault weight_1e-3 --fault scale_byte \
    $(alt 560 560) --layout b300-tp8 --layout mi355x-tp8 > $OUT/cpuf.log 2>&1 &
  timeout $T $C --out $W/cuda --device cuda --golden-device cuda --workers 6 --no-faults $(alt 900 914) $L2 \
    > $OUT/cuda.log 2>&1 &
elif [ "$PART" = exact3 ]; then  # more of exact2's held-out clean bundles, new seeds
  timeout $T $C --out $W/cpu --device cpu --workers 12 --no-faults $(alt 813 826) $L3 > $OUT/cpu.log 2>&1 &
  timeout $T $C --out $W/cuda --device cuda --golden-device cuda --workers 4 --no-faults $(alt 915 925) $L2 \
    > $OUT/cuda.log 2>&1 &
elif [ "$PART" = added ]; then
  timeout $T $C --out $W/cpuf --device cpu --workers 5 --faults-only $(alt 1000 1001) $L3 > $OUT/cpuf.log 2>&1 &
  timeout $T $C --out $W/cudaf --device cuda --workers 4 --faults-only $(alt 1040 1041) --layout b300-tp8 \
    > $OUT/cudaf.log 2>&1 &
  timeout $T $C --out $W/cpu --device cpu --workers 4 --no-faults $(alt 1100 1109) $L3 > $OUT/cpu.log 2>&1 &
  timeout $T $C --out $W/cuda --device cuda --workers 2 --no-faults $(alt 1140 1149) $L2 > $OUT/cuda.log 2>&1 &
else
  timeout $T $C --out $W/cpu --device cpu --workers 6 $(alt 3 4) $L3 > $OUT/cpu.log 2>&1 &
  timeout $T $C --out $W/cpuf --device cpu --workers 6 --faults-only $(alt 500 501) $L3 > $OUT/cpuf.log 2>&1 &
  timeout $T $C --out $W/cuda --device cuda --workers 4 --faults-only $(alt 600 601) $L2 > $OUT/cuda.log 2>&1 &
fi
wait
for d in $W/*/; do n=$(basename $d); [ -f $d/records.jsonl ] && gzip -c $d/records.jsonl > $OUT/$PART-$n.jsonl.gz; tail -2 $OUT/$n.log; done
tail -5 $OUT/pytest-gpu.log 2>/dev/null
ls -la $OUT
