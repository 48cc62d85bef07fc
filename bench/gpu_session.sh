#!/usr/bin/env bash
# One device-machine session: GPU/NCCL tests, calibration runs and the demo on CUDA.
# Usage (on a machine with 2 GPUs, from the repository root): bash bench/gpu_session.sh OUT_DIR
# Wheels for packages the machine lacks (zstandard, fla-core) are installed from .whl/ if present.
set -uo pipefail
OUT=${1:?OUT_DIR}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' | tee -a "$OUT/gpus.txt"
K="python3 -m k3bundle"
W=/tmp/k3w; rm -rf $W; mkdir -p $W/cases
for c in greedy thinking tool_call multi_turn long_context image; do cp golden/cases/$c.yaml $W/cases/; done
t() { local s=$EPOCHREALTIME; "$@"; local rc=$?; echo "TIME $(awk "BEGIN{printf \"%.1f\", $EPOCHREALTIME - $s}") s rc=$rc: $*" | tee -a "$OUT/times.txt"; return $rc; }
[ "${SKIP_CPU_TESTS:-0}" = 1 ] || t python3 -m pytest -q -x -p no:cacheprovider tests/test_one_forward.py tests/test_validate_devices.py tests/test_validate.py 2>&1 | tail -15 | tee "$OUT/pytest-cpu.txt"
t $K synth --preset tiny --out $W/tiny >/dev/null
for l in tp2 ep2; do  # the test layouts of tests/test_validate.py
  t $K convert $W/tiny --target tests/layouts/tiny-$l.yaml --out $W/b-$l >/dev/null
done
t $K golden $W/b-tp2 --device cuda --cases $W/cases --long-tokens 2048 --out $W/g-cuda >/dev/null
t $K golden $W/b-tp2 --device cpu --cases $W/cases --long-tokens 2048 --out $W/g-cpu >/dev/null
for b in tp2 ep2; do cp -r $W/g-cuda $W/b-$b/validation; done
t $K validate $W/b-tp2 --device cuda --json --out $W/r-merged > "$OUT/signoff-cuda-merged.json"
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  t $K validate $W/b-tp2 --device cuda --ranks distributed --json --out $W/r-dist > "$OUT/signoff-cuda-tp2-nccl.json"
  t $K validate $W/b-ep2 --device cuda --ranks distributed --json --out $W/r-ep > "$OUT/signoff-cuda-ep2-nccl.json"
fi
t $K validate $W/b-tp2 --device cpu --json --out $W/r-cpu > "$OUT/signoff-cpu-merged.json"
cp $W/r-merged/signoff.json "$OUT/full-cuda-merged.json"; cp $W/r-cpu/signoff.json "$OUT/full-cpu-merged.json"
t $K demo --out $W/demo --force --device cuda 2>&1 | tail -12 | tee "$OUT/demo-cuda.txt"
t timeout ${PYTEST_TIMEOUT:-900} python3 -m pytest -q -rs -p no:cacheprovider -m "gpu or multi_gpu" tests/test_validate_gpu.py tests/test_executor_gpu.py -s 2>&1 | tail -40 | tee "$OUT/pytest-gpu.txt"
