#!/usr/bin/env bash
# The H200 measurements of docs/performance.md "Kernels", one device call per stage:
#   bash bench/kernels_gpu.sh ops      # k3bundle kernels: fla / torch at three layouts' per-rank shapes
#   bash bench/kernels_gpu.sh anchor   # fla chunk_kda at the unsharded width, 16,384 tokens (the 5.6 ms anchor)
#   bash bench/kernels_gpu.sh models   # a tiny bundle validated on CUDA with --backend fla / torch / a planted bug
#   bash bench/kernels_gpu.sh wide     # synth --preset full-width (release widths, 4 layers) -> h200-tp16-ep16,
#                                      # goldens on CUDA, validate --backend fla
# Several stages in one call: bash bench/kernels_gpu.sh anchor models. Every report lands in one
# tarball, $OUT/kernels-gpu.tgz (the device tool returns at most 8 files).
# Run through the device tool with carry [".whl"] (zstandard, fla-core, einops wheels for cp312).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
FINAL=${OUT:-/tmp/out}
OUT=/tmp/kernels-gpu
mkdir -p "$OUT" "$FINAL"
trap 'tar czf "$FINAL/kernels-gpu.tgz" -C "$OUT" .' EXIT
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
k3() { python3 -m k3bundle "$@"; }
stage() {
case "$1" in
ops)
  for tgt in ${TARGETS:-gb300-dep16 b300-tp8 h200-tp16-ep16}; do
    for be in ${BACKENDS:-fla torch}; do
      echo "== $tgt $be"
      SECONDS=0
      timeout 170 python3 -m k3bundle kernels --target "$tgt" --backend "$be" --device cuda --tokens 8192 --batch 64 \
        --context 4096 --out "$OUT/$tgt-$be" > "$OUT/$tgt-$be.md" 2> "$OUT/$tgt-$be.err"
      echo "rc=$? ${SECONDS}s"; grep -E "^(PASS|FAIL)" "$OUT/$tgt-$be.md"; tail -3 "$OUT/$tgt-$be.err"
    done
  done
  for be in fla torch; do  # decode at batch 256
    timeout 100 python3 -m k3bundle kernels --target gb300-dep16 --backend "$be" --device cuda --batch 256 --context 4096 \
      --ops kda_recurrent_decode --ops gated_mla_decode_latent_cache --case batch_n --out "$OUT/gb300-dep16-$be-b256" \
      > "$OUT/gb300-dep16-$be-b256.md" 2>&1; echo "b256 $be rc=$?"
  done
  ;;
anchor)
  timeout 150 python3 -m k3bundle kernels --target gb300-dep16 --backend fla --device cuda --tokens 16384 \
    --ops kda_chunked_prefill --case random --out "$OUT/anchor" > "$OUT/anchor.md" 2>&1
  echo "anchor rc=$?"; grep -E "^\| kda_chunked_prefill" "$OUT/anchor.md"
  ;;
models)
  W=/tmp/w; mkdir -p $W
  SECONDS=0
  [ -d $W/b ] && rm -rf $W
  k3 synth --preset tiny --out $W/tiny > /dev/null && k3 convert $W/tiny --target h200-tp16-ep16 --out $W/b > /dev/null \
    && k3 golden $W/tiny --out $W/b/validation --device cuda > /dev/null || exit 1
  echo "synth + convert + golden (cuda): ${SECONDS}s"
  for be in ${MODEL_BACKENDS:-fla torch planted:kda_state_transposed planted:mxfp4_nvfp4_scale_stride}; do
    SECONDS=0
    timeout 150 python3 -m k3bundle validate $W/b --device cuda --backend "$be" --out "$OUT/validate-${be/:/-}" \
      > "$OUT/validate-${be/:/-}.txt" 2>&1
    echo "== validate --backend $be: rc=$? ${SECONDS}s"; head -8 "$OUT/validate-${be/:/-}.txt"
  done
  ;;
wide)
  W=/tmp/wide; rm -rf $W; mkdir -p $W
  SECONDS=0; k3 synth --preset full-width --out $W/fw > "$OUT/wide-synth.txt" 2>&1 || { tail -3 "$OUT/wide-synth.txt"; return 1; }
  echo "synth full-width: ${SECONDS}s"; du -sh $W/fw
  SECONDS=0; k3 convert $W/fw --target h200-tp16-ep16 --out $W/b > "$OUT/wide-convert.txt" 2>&1 || { tail -3 "$OUT/wide-convert.txt"; return 1; }
  echo "convert h200-tp16-ep16: ${SECONDS}s"
  mkdir -p $W/cases; for c in ${WIDE_CASES:-greedy multi_turn long_context}; do cp golden/cases/$c.yaml $W/cases/; done
  SECONDS=0; k3 golden $W/fw --out $W/b/validation --device cuda --cases $W/cases --long-tokens ${WIDE_LONG:-1024} \
    > "$OUT/wide-golden.txt" 2>&1 \
    || { tail -3 "$OUT/wide-golden.txt"; return 1; }
  echo "golden (cuda): ${SECONDS}s"; tail -4 "$OUT/wide-golden.txt"
  SECONDS=0; timeout ${WIDE_VALIDATE_S:-400} python3 -m k3bundle validate $W/b --device cuda --backend fla \
    --out "$OUT/validate-wide-fla" > "$OUT/validate-wide-fla.txt" 2>&1
  echo "== validate full-width --backend fla: rc=$? ${SECONDS}s"; head -16 "$OUT/validate-wide-fla.txt"
  ;;
esac
}
for s in "${@:-ops}"; do stage "$s"; done
