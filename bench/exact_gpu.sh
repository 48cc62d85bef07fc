#!/usr/bin/env bash
# The H200 measurements of docs/performance.md "Exact reference at full width", one device call:
#   bash bench/exact_gpu.sh tests     # the GPU tests of the MXFP4 kernel and the executor's forms
#   bash bench/exact_gpu.sh decode    # bench/mxfp4_decode.py: the Triton codec and the fused matmul against torch and a copy
#   bash bench/exact_gpu.sh mla       # bench/mla_prefill.py: the fused MLA prefill kernel against the blocked form
#   bash bench/exact_gpu.sh layers    # bench/executor.py gpu-layers: bf16 and float32 policies, fast and readable
#   bash bench/exact_gpu.sh e2e       # bench/golden_full_width.py: a reduced-depth release-width model through goldens
# Env DECODE_ARGS, MLA_ARGS, LAYERS_ARGS, E2E_ARGS replace a stage's arguments.
# Several stages in one call: bash bench/exact_gpu.sh tests decode layers. Reports land in $OUT.
# Run through the device tool with carry [".whl"] (zstandard, fla-core, einops wheels for cp312).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for stage in "$@"; do
  SECONDS=0
  case "$stage" in
  tests)
    python3 -m pytest -q -p no:cacheprovider tests/test_formats_mxfp4_gpu.py tests/test_executor_fast.py \
      tests/test_executor_gpu.py tests/test_executor_mla_gpu.py 2>&1 | tee "$OUT/tests.txt" | tail -15 ;;
  decode)
    python3 bench/mxfp4_decode.py --device cuda --experts 16 ${DECODE_ARGS:---matmul 1 4} | tee "$OUT/mxfp4-decode.json" ;;
  mla)
    python3 bench/mla_prefill.py ${MLA_ARGS:---tokens 8192 2048 32768 131072} --json "$OUT/mla-prefill.json" \
      | tee "$OUT/mla-prefill.md" ;;
  layers)
    python3 bench/executor.py gpu-layers ${LAYERS_ARGS:-} --json "$OUT/gpu-layers.json" | tee "$OUT/gpu-layers.md" ;;
  e2e)
    python3 bench/golden_full_width.py ${E2E_ARGS:-} --json "$OUT/golden-full-width.json" | tee "$OUT/golden-full-width.md" ;;
  *) echo "unknown stage $stage"; exit 2 ;;
  esac
  echo "== $stage: ${SECONDS}s"
done
