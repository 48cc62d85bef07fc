"""MLA prefill attention (M4) at the release's width: the fast form against the form it replaced.

    python bench/mla_prefill.py --tokens 8192 2048 32768 131072 --score-gib 1 8   # H200, via the device tool
    python bench/mla_prefill.py --tokens 8192 --sweep                              # the kernel's tile configs

96 heads, head dim 192 (nope 128 + rope 64), values 128, causal, no prefix. BF16: the fused kernel
``mla_gpu.attend`` (the fast form on CUDA) and ``mla.attend_blocked`` (the form it replaced,
skipped beyond ``--blocked-max``). FP32: ``mla.attend_blocked`` (the fast form: cuBLAS FP32
GEMMs) at each ``--score-gib`` cap on its score blocks, and at the first length the kernel's FP32
path for the record (not used on CUDA: ``mla_gpu.available``). Time = median of 3 after a warm-up
(one run, no warm-up, beyond 32,768 tokens), attention FLOPs H·(E + V)·T² (the causal half of
2·H·(E + V)·T²) per second, and, at the first length, each form's relative L2 error against
``mla.attend_naive`` in float64 on the first ``--check-heads`` heads. Prints a markdown table;
``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from executor import timed  # noqa: E402  (bench/executor.py)
from k3bundle.executor import mla, mla_gpu  # noqa: E402

H, E, V = 96, 192, 128
SWEEP = {torch.bfloat16: [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 3), (64, 128, 4, 2),
                          (64, 64, 8, 2)],
         torch.float32: []}


def inputs(T, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, H, E, device="cuda", generator=g).to(dtype)
    k = torch.randn(T, H, E, device="cuda", generator=g).to(dtype)
    v = torch.randn(T, H, V, device="cuda", generator=g).to(dtype)
    return q, k, v


def rel(a, b) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--blocked-max", type=int, default=32768, help="longest prompt the BF16 blocked form runs at")
    ap.add_argument("--score-gib", type=float, nargs="+", default=[1.0],
                    help="caps on the FP32 blocked form's score blocks (mla.SCORE_BYTES), GiB")
    ap.add_argument("--check-heads", type=int, default=8)
    ap.add_argument("--sweep", action="store_true", help="time every tile config of SWEEP at the first length")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    scale = E ** -0.5
    rows = []
    print("| dtype | form | T | ms | attention TFLOP/s | rel. error vs float64 |")
    print("|---|---|---:|---:|---:|---:|")
    for dtype in (torch.bfloat16, torch.float32):
        for i, T in enumerate(args.tokens):
            q, k, v = inputs(T, dtype)
            flops = H * (E + V) * T * T
            forms = {}
            if dtype == torch.bfloat16:
                forms["fused kernel"] = lambda: mla_gpu.attend(q, k, v, 0, scale)
                if T <= args.blocked_max:
                    forms["blocked (before)"] = lambda: mla.attend_blocked(q, k, v, 0, scale)
            else:
                for gib in args.score_gib:
                    forms[f"blocked, {gib:g} GiB score blocks"] = lambda gib=gib: blocked_capped(q, k, v, scale, gib)
                if i == 0:
                    forms["fused kernel, FP32 path (not used)"] = lambda: mla_gpu.attend(q, k, v, 0, scale)
            if args.sweep and i == 0:
                for cfg in SWEEP[dtype]:
                    forms[f"kernel {cfg}"] = lambda cfg=cfg: mla_gpu.attend(q, k, v, 0, scale, config=cfg)
            ref = None
            if i == 0:
                h = slice(0, args.check_heads)
                ref = mla.attend_naive(q[:, h].double(), k[:, h].double(), v[:, h].double(), 0, scale)
            for name, fn in forms.items():
                try:
                    s = timed(fn, "cuda") if T <= 32768 else timed(fn, "cuda", reps=1, warmup=0)
                except Exception as e:  # a tile config that does not compile here: say so, go on
                    print(f"| {str(dtype)[6:]} | {name} | {T} | failed: {type(e).__name__}: {str(e)[:80]} | | |")
                    continue
                err = rel(fn()[:, :args.check_heads], ref) if ref is not None else None
                row = {"dtype": str(dtype)[6:], "form": name, "tokens": T, "ms": s * 1e3,
                       "tflops": flops / s / 1e12, "rel_err_vs_f64": err}
                rows.append(row)
                print(f"| {row['dtype']} | {name} | {T} | {row['ms']:.2f} | {row['tflops']:.1f} | "
                      f"{'' if err is None else f'{err:.2e}'} |", flush=True)
                if args.json:
                    args.json.write_text(json.dumps(rows, indent=1))
            q = k = v = forms = None  # free before the next length
            torch.cuda.empty_cache()


def blocked_capped(q, k, v, scale, gib: float):
    keep, mla.SCORE_BYTES = mla.SCORE_BYTES, int(gib * 2**30)
    try:
        return mla.attend_blocked(q, k, v, 0, scale)
    finally:
        mla.SCORE_BYTES = keep


if __name__ == "__main__":
    main()
