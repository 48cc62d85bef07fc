#!/usr/bin/env bash
# One device-machine call (16 cores + one H200) for bench/calibrate.py: calibration seeds with
# planted faults (CPU), held-out clean bundles (CPU), held-out clean + faulted bundles (CUDA).
# Usage: bash bench/device_calibrate.sh OUT   (wheels for zstandard etc. in .whl/)
set -u
OUT=${1:?OUT}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
nproc; nvidia-smi -L
L="--layout b300-tp8 --layout gb300-dep16 --layout mi355x-tp8"
alt() { for s in $(seq $1 $2); do echo "--preset tiny:$s --preset tiny-trained:$s"; done; }
W=/tmp/cal; mkdir -p $W
T=${CAL_SECONDS:-480}
timeout $T python3 bench/calibrate.py run --out $W/cuda --device cuda --workers 3 --threads 1 --long-tokens 256 \
  $(alt 200 209) --layout b300-tp8 --layout gb300-dep16 > $OUT/cuda.log 2>&1 &
timeout $T python3 bench/calibrate.py run --out $W/cal --device cpu --workers 4 --threads 1 --long-tokens 256 \
  $(alt 0 2) $L > $OUT/cal.log 2>&1 &
timeout $T python3 bench/calibrate.py run --out $W/held --device cpu --workers 9 --threads 1 --long-tokens 256 \
  --no-faults $(alt 100 139) $L > $OUT/held.log 2>&1 &
wait
for d in cuda cal held; do gzip -c $W/$d/records.jsonl > $OUT/$d.jsonl.gz; tail -2 $OUT/$d.log; done
ls -la $OUT
