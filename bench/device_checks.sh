#!/usr/bin/env bash
# One device-machine call, every check in parallel, results in $OUT:
#   digest  bench/synth_digest.py --small on this host's CPU (docs/synthetic-models.md "Identical on
#           every machine": a physical machine of another class)
#   pinned  tests/test_pinned_outputs.py on this host's CPU (checkpoint and bundle bytes, golden
#           decisions and float64 fingerprint) and the float32 goldens' content hash here
#   gpu     tests/test_validate_gpu.py: CUDA goldens, faults located, the exact check, and the
#           rank path at world size one under NCCL
#   added   held-out clean bundles on CUDA under the shipped rules (added limits widened with the
#           goldens' BF16 noise), tiny and tiny-trained seeds 1140-1149, b300-tp8 and gb300-dep16
#   clean   held-out clean bundles on CPU, every shipped storage format (b300-tp8 NVFP4, gb300-dep16
#           MXFP4 pass-through, mi355x-tp8 FP8), tiny and tiny-trained, seeds CLEAN_SEEDS
#           (default 1400-1409: 60 bundles), long context at LONG_TOKENS (default 8192)
#   small   held-out clean `small` bundles on CPU (13 layers, width 1,024), SMALL_SEEDS (default
#           1400-1401) x every shipped layout, long context at LONG_TOKENS, SMALL_WORKERS (default 3)
#   fullwidth  held-out clean `full-width` bundles on CPU (release widths, 4 layers), FW_SEEDS
#           (default 1400-1401), b300-tp8 and gb300-dep16, long context at FW_LONG_TOKENS (default 1024)
#   fulldepth  clean full-depth bundles (93 layers), FD_SEEDS (default 1-5), bench/full_depth_seeds.sh
# Usage: bash bench/device_checks.sh [STAGE ...] (default: all), through the device tool with
# carry [".whl"]. CAL_SECONDS bounds the added stage (default 420).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STAGES=${*:-digest pinned gpu added}
alt() { for s in $(seq $1 $2); do echo "--preset tiny:$s --preset tiny-trained:$s"; done; }
nvidia-smi -L > "$OUT/machine.txt" 2>&1; grep -m1 "model name" /proc/cpuinfo >> "$OUT/machine.txt"; nproc >> "$OUT/machine.txt"
python3 -c "import torch, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__)" >> "$OUT/machine.txt"
for stage in $STAGES; do
  case "$stage" in
  digest) (OMP_NUM_THREADS=2 python3 bench/synth_digest.py --small > "$OUT/synth-digest.json" 2> "$OUT/synth-digest.err") & ;;
  pinned) (OMP_NUM_THREADS=1 timeout 580 python3 -m pytest -q -p no:cacheprovider tests/test_pinned_outputs.py > "$OUT/pinned.txt" 2>&1
           OMP_NUM_THREADS=1 python3 bench/golden_hash.py > "$OUT/golden-hash.json" 2>&1) & ;;
  gpu) (timeout 580 python3 -m pytest -q -rs -p no:cacheprovider tests/test_validate_gpu.py > "$OUT/pytest-gpu.txt" 2>&1) & ;;
  added) (OMP_NUM_THREADS=1 timeout ${CAL_SECONDS:-420} python3 bench/calibrate.py run --threads 1 --long-tokens 256 \
            --out /tmp/cal-added-cuda --device cuda --workers 6 --no-faults $(alt 1140 1149) \
            --layout b300-tp8 --layout gb300-dep16 > "$OUT/added-cuda.log" 2>&1
          gzip -c /tmp/cal-added-cuda/records.jsonl > "$OUT/added-cuda.jsonl.gz") & ;;
  clean) (CS=${CLEAN_SEEDS:-1400-1409}; OMP_NUM_THREADS=1 timeout ${CAL_SECONDS:-420} python3 bench/calibrate.py run \
            --threads 1 --long-tokens ${LONG_TOKENS:-8192} --out /tmp/cal-clean-cpu --device cpu --workers ${WORKERS:-10} \
            --no-faults $(alt ${CS%-*} ${CS#*-}) --layout b300-tp8 --layout gb300-dep16 --layout mi355x-tp8 \
            > "$OUT/clean-cpu.log" 2>&1
          gzip -c /tmp/cal-clean-cpu/records.jsonl > "$OUT/clean-cpu.jsonl.gz") & ;;
  small) (SS=${SMALL_SEEDS:-1400-1401}; OMP_NUM_THREADS=1 timeout ${CAL_SECONDS:-420} python3 bench/calibrate.py run \
            --threads 1 --long-tokens ${LONG_TOKENS:-8192} --out /tmp/cal-small-cpu --device cpu --workers ${SMALL_WORKERS:-3} \
            --no-faults --preset small:$SS --layout b300-tp8 --layout gb300-dep16 --layout mi355x-tp8 \
            > "$OUT/small-cpu.log" 2>&1
          gzip -c /tmp/cal-small-cpu/records.jsonl > "$OUT/small-cpu.jsonl.gz") & ;;
  fullwidth) (OMP_NUM_THREADS=2 timeout ${CAL_SECONDS:-420} python3 bench/calibrate.py run \
            --threads 2 --long-tokens ${FW_LONG_TOKENS:-1024} --out /tmp/cal-fw-cpu --device cpu --workers ${FW_WORKERS:-2} \
            --no-faults --preset full-width:${FW_SEEDS:-1400-1401} --layout b300-tp8 --layout gb300-dep16 \
            > "$OUT/fullwidth-cpu.log" 2>&1
          gzip -c /tmp/cal-fw-cpu/records.jsonl > "$OUT/fullwidth-cpu.jsonl.gz") & ;;
  fulldepth) (SEEDS="${FD_SEEDS:-1 2 3 4 5}" JOBS=5 OMP_NUM_THREADS=3 timeout 580 bash bench/full_depth_seeds.sh \
            "$OUT/full-depth" > "$OUT/full-depth.txt" 2>&1) & ;;
  *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
wait
tail -3 "$OUT"/*.txt "$OUT"/*.log 2>/dev/null; cat "$OUT/synth-digest.json" "$OUT/golden-hash.json" 2>/dev/null
