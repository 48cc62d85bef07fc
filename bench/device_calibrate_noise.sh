#!/usr/bin/env bash
# A short device-machine call after the BF16-noise rule (golden/noise.py): held-out clean bundles,
# random and trained tiny, on CUDA (3 workers) and on the host's CPU (12 workers), CAL_SECONDS long.
set -u
OUT=${1:?OUT}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/zstandard*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
alt() { for s in $(seq $1 $2); do echo "--preset tiny:$s --preset tiny-trained:$s"; done; }
W=/tmp/cal; mkdir -p $W; T=${CAL_SECONDS:-140}
timeout $T python3 bench/calibrate.py run --out $W/cuda --device cuda --workers 4 --threads 1 --long-tokens 256 \
  --no-faults $(alt 300 309) --layout b300-tp8 > $OUT/cuda.log 2>&1 &
timeout $T python3 bench/calibrate.py run --out $W/cpu --device cpu --workers 11 --threads 1 --long-tokens 256 \
  --no-faults $(alt 400 439) --layout b300-tp8 --layout mi355x-tp8 > $OUT/cpu.log 2>&1 &
wait
for d in cuda cpu; do gzip -c $W/$d/records.jsonl > $OUT/$d.jsonl.gz; tail -1 $OUT/$d.log; done
