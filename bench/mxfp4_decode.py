"""MXFP4 -> bf16 decode throughput: k3bundle's codec (the Triton kernel on CUDA) against its torch
form, its former f32 path and a plain copy.

    python bench/mxfp4_decode.py --device cuda --experts 16     # JSON on stdout
    python bench/mxfp4_decode.py --device cuda --experts 16 --matmul 1 4

Decodes ``experts`` routed experts at the release's shape (3 projections of 3,072 x 3,584 each
way: 33 Mi E2M1 codes per expert) with ``formats.mxfp4.dequantize`` to bf16 (one Triton kernel on CUDA,
``formats/mxfp4_gpu.py``), with its torch form (``dequantize_torch``: gather, scale, multiply in bf16)
and with the path that replaced (an int64-indexed gather in f32, scale, cast), checks all three bit for bit, and
reports GB/s of *packed input* next to the same device's copy bandwidth (read + write of a plain
``copy_`` of the bf16 output's size: the HBM ceiling of any decode that writes bf16).
``--matmul`` also times the fused matmul of a decode step (``mxfp4.matmul_stack``: the weights
decoded in registers, nothing written) for the experts' three projections at N tokens each, in
GB/s of packed input, against the readable decode-then-``bmm`` and float64.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from executor import copy_bandwidth, timed  # noqa: E402  (bench/executor.py)
from k3bundle.formats import e2m1, mxfp4, mxfp4_gpu  # noqa: E402


def f32_path(packed, scales):
    """The decode as it was: an int64-indexed table gather in f32, the scale multiply in f32, the cast."""
    lead, nb = scales.shape[:-1], scales.shape[-1]
    values = torch.tensor(e2m1.VALUES, dtype=torch.float32, device=packed.device)
    byte = torch.arange(256, device=packed.device)
    pairs = torch.stack((values[byte & 0xF], values[byte >> 4]), dim=-1)
    vals = torch.nn.functional.embedding(packed.reshape(-1).long(), pairs).reshape(*lead, nb, mxfp4.BLOCK)
    f = mxfp4.pow2(scales.to(torch.int32) - mxfp4.E8M0_BIAS, torch.float32)
    f = torch.where(scales == mxfp4.E8M0_NAN, float("nan"), f)
    return (vals * f[..., None]).reshape(*lead, nb * mxfp4.BLOCK).to(torch.bfloat16)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN blocks as NaN (a NaN's payload and sign are not part of the format)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))


def matmul_rows(dev, experts: int, tokens: list[int], I: int = 3072, L: int = 3584) -> dict:
    """A decode step's routed experts reading MXFP4 directly (``mxfp4.matmul_stack``): the three
    projections of ``experts`` experts at the release's shape for N tokens each, against the
    readable form (decode to a stacked buffer, then a batched GEMM) and the HBM copy rate."""
    g = torch.Generator(device=dev).manual_seed(1)
    shapes = {"w1": (I, L), "w3": (I, L), "w2": (L, I)}
    w = {r: ([torch.randint(0, 256, (R, C // 2), dtype=torch.uint8, device=dev, generator=g) for _ in range(experts)],
             [torch.randint(118, 124, (R, C // 32), dtype=torch.uint8, device=dev, generator=g) for _ in range(experts)])
         for r, (R, C) in shapes.items()}
    nbytes = sum(p.numel() + s.numel() for ps, ss in w.values() for p, s in zip(ps, ss))
    copy = copy_bandwidth(dev, nbytes)
    out = {"packed_bytes": nbytes, "copy_GBps_read_plus_write": round(copy / 1e9, 1), "rows": []}
    for dtype in (torch.bfloat16, torch.float32):
        for n in tokens:
            xs = {r: torch.randn(experts, n, C, device=dev, generator=g).to(dtype) for r, (R, C) in shapes.items()}
            fused = lambda: [mxfp4.matmul_stack(xs[r], *w[r]) for r in shapes]  # noqa: E731
            stacks = {r: torch.empty(experts, R, C, dtype=dtype, device=dev) for r, (R, C) in shapes.items()}

            def readable():
                return [torch.bmm(xs[r], mxfp4.dequantize_stack(*w[r], stacks[r]).transpose(1, 2)) for r in shapes]
            got, want = fused(), readable()
            exact = [torch.bmm(xs[r].double(), stacks[r].double().transpose(1, 2)) for r in shapes]
            rel = lambda ys: max(((y.double() - e).norm() / e.norm()).item() for y, e in zip(ys, exact))  # noqa: E731
            t_f, t_r = timed(fused, dev, reps=20), timed(readable, dev, reps=5)
            row = {"dtype": str(dtype).removeprefix("torch."), "tokens": n, "fused_ms": round(t_f * 1e3, 4),
                   "fused_GBps_packed": round(nbytes / t_f / 1e9, 1), "readable_ms": round(t_r * 1e3, 3),
                   "speedup": round(t_r / t_f, 1), "rel_err_vs_f64": float(f"{rel(got):.3g}"),
                   "readable_rel_err_vs_f64": float(f"{rel(want):.3g}")}
            out["rows"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            stacks = None  # free before the next row
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--rows", type=int, default=3 * 3072)
    p.add_argument("--cols", type=int, default=3584)
    p.add_argument("--sweep", action="store_true", help="also time the kernel's block sizes and warp counts")
    p.add_argument("--matmul", type=int, nargs="*", default=[], metavar="N",
                   help="also time the fused matmul a decode step uses at N tokens per expert (e.g. 1 4 16)")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    g = torch.Generator(device=dev).manual_seed(0)
    packed = torch.randint(0, 256, (args.experts, args.rows, args.cols // 2), dtype=torch.uint8, device=dev, generator=g)
    scales = torch.randint(110, 135, (args.experts, args.rows, args.cols // 32), dtype=torch.uint8, device=dev,
                           generator=g)
    scales[0, 0, :3] = torch.tensor([0, 254, 255], dtype=torch.uint8)  # subnormal, overflow, NaN blocks
    new, old = mxfp4.dequantize(packed, scales, torch.bfloat16), f32_path(packed, scales)
    equal = same(new, old)
    del old
    portable = mxfp4.dequantize_torch(packed, scales, torch.bfloat16)
    equal = equal and same(new, portable)
    del new, portable
    in_bytes = packed.numel() + scales.numel()
    t_new = timed(lambda: mxfp4.dequantize(packed, scales, torch.bfloat16), dev, reps=5)
    t_torch = timed(lambda: mxfp4.dequantize_torch(packed, scales, torch.bfloat16), dev, reps=5)
    t_f32 = timed(lambda: mxfp4.dequantize(packed, scales, torch.float32), dev, reps=5)
    t_old = timed(lambda: f32_path(packed, scales), dev, reps=5)
    copy = copy_bandwidth(dev, packed.numel() * 4)  # bf16 output bytes
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "experts": args.experts, "packed_input_bytes": in_bytes,
           "bit_identical": equal,
           "codec": "triton" if dev.type == "cuda" and mxfp4_gpu.available(packed, torch.bfloat16) else "torch",
           "bf16_path_ms": round(t_new * 1e3, 3), "bf16_path_GBps_packed": round(in_bytes / t_new / 1e9, 1),
           "torch_form_ms": round(t_torch * 1e3, 3), "torch_form_GBps_packed": round(in_bytes / t_torch / 1e9, 1),
           "to_f32_ms": round(t_f32 * 1e3, 3), "to_f32_GBps_packed": round(in_bytes / t_f32 / 1e9, 1),
           "f32_path_ms": round(t_old * 1e3, 3), "f32_path_GBps_packed": round(in_bytes / t_old / 1e9, 1),
           "speedup": round(t_old / t_new, 2), "copy_GBps_read_plus_write": round(copy / 1e9, 1),
           "ceiling_GBps_packed": round(copy / 1e9 * in_bytes / (in_bytes + packed.numel() * 4), 1)}
    if args.sweep and out["codec"] == "triton":
        keep = mxfp4_gpu.BYTES_PER_PROGRAM, mxfp4_gpu.NUM_WARPS
        sweep = {}
        for block in (1024, 2048, 4096, 8192, 16384):
            for warps in (2, 4, 8, 16):
                mxfp4_gpu.BYTES_PER_PROGRAM, mxfp4_gpu.NUM_WARPS = block, warps
                t = timed(lambda: mxfp4.dequantize(packed, scales, torch.bfloat16), dev, reps=5)
                sweep[f"{block}x{warps}"] = round(in_bytes / t / 1e9, 1)
        mxfp4_gpu.BYTES_PER_PROGRAM, mxfp4_gpu.NUM_WARPS = keep
        out["sweep_bf16_GBps_packed"] = sweep
    if args.matmul and out["codec"] == "triton":
        del packed, scales
        out["matmul"] = matmul_rows(dev, args.experts, args.matmul)
        equal = equal and all(r["rel_err_vs_f64"] <= r["readable_rel_err_vs_f64"] * 1.5 + 1e-7
                              for r in out["matmul"]["rows"])
    print(json.dumps(out, indent=1))
    if not equal:
        raise SystemExit("the decode paths differ")


if __name__ == "__main__":
    main()
