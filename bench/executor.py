"""Executor benchmarks (docs/performance.md "Executor", docs/executor.md "Deviations").

Three subcommands, each printing a Markdown table and, with ``--json FILE``, writing JSON:

``cpu``: prefill and decode tokens/s of the whole model on a synth checkpoint, streaming
(weights re-read per layer) and resident, against lower bounds measured in the same run:
prefill FLOPs at this machine's fp32 matmul rate, decode bytes at its copy bandwidth.

    /usr/bin/time -v python bench/executor.py cpu --source /tmp/k3-small --tokens 128 --decode 8 --mode streaming

``gpu-layers``: one KDA, one MLA and one MoE layer at full Kimi K3 width (random weights made
on the device, 896 MXFP4 experts kept packed and dequantized lazily when routed), bf16
policy, prefill and decode, against max(bytes / HBM bandwidth, FLOPs / bf16 peak), with the
datasheet H200 peaks (4.8 TB/s, 990 TFLOP/s) and the ceilings measured in the same run.

    python bench/executor.py gpu-layers --tokens 2048 --context 4096

``deviation``: taps of float32 and bfloat16 runs on a device against CPU float64, free-running
and with routing teacher-forced from the float64 run.

    python bench/executor.py deviation --source /tmp/k3-tiny --source /tmp/k3-small --device cuda
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3bundle.config import load_config, release_config_path  # noqa: E402
from k3bundle.executor import Executor, SourceWeights, TapRecorder, kda, latent_moe, mla  # noqa: E402
from k3bundle.executor.cache import KDAState, MLAState  # noqa: E402
from k3bundle.executor.weights import LayerWeights  # noqa: E402
from k3bundle.formats import mxfp4  # noqa: E402
from k3bundle.schema import Format, Schema, Scope  # noqa: E402

H200_BW, H200_BF16 = 4.8e12, 990e12  # datasheet, spec task brief


# ---------------------------------------------------------------- measured ceilings
def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device="cpu", reps=3, warmup=1) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def matmul_rate(device, dtype, m, k, n) -> float:
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    return 2 * m * k * n / timed(lambda: a @ b, device, reps=5)


def copy_bandwidth(device, nbytes) -> float:
    """Bytes moved per second (read + write) by a plain tensor copy."""
    a = torch.empty(nbytes // 4, device=device, dtype=torch.float32).uniform_()
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / timed(lambda: b.copy_(a), device, reps=5)


# ---------------------------------------------------------------- cpu
def cpu(args) -> dict:
    cfg = load_config(args.source)
    t = cfg.text
    totals = Schema(cfg).totals
    esize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    # ceilings in a child process, so that their buffers do not count in this process's peak RSS
    child = subprocess.run([sys.executable, __file__, "ceilings", "--m", str(args.tokens), "--k",
                            str(t.hidden_size), "--n", str(4 * t.hidden_size)],
                           capture_output=True, text=True, check=True)
    mm, bw = (json.loads(child.stdout)[k] for k in ("matmul_flops", "copy_bytes_s"))
    flops_tok = 2 * totals.active_params  # matmul FLOPs only: a lower bound
    ids = torch.randint(0, t.vocab_size - 256, (args.tokens + args.decode,),
                        generator=torch.Generator().manual_seed(0))
    rows = []
    for resident in {"streaming": (False,), "resident": (True,), "both": (False, True)}[args.mode]:
        # streaming = the bounded-memory path: no expert cache either
        w = SourceWeights(args.source, dtype=args.dtype, resident=resident, expert_cache=None if resident else 0)
        ex = Executor(w)
        ex.prefill(ids[:4])  # page cache / resident weights warm
        t0 = time.perf_counter()
        _, cache = ex.prefill(ids[: args.tokens])
        t1 = time.perf_counter()
        for i in range(args.decode):
            ex.decode(int(ids[args.tokens + i]), cache)
        t2 = time.perf_counter()
        prefill_s, decode_s = t1 - t0, (t2 - t1) / args.decode
        rows.append({
            "mode": "resident" if resident else "streaming", "dtype": args.dtype,
            "prefill_tokens": args.tokens, "prefill_tok_s": args.tokens / prefill_s,
            "prefill_bound_tok_s": mm / flops_tok,
            "decode_tok_s": 1 / decode_s, "decode_bound_tok_s": bw / (totals.active_params * esize),
        })
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    res = {"source": str(args.source), "threads": torch.get_num_threads(), "peak_rss": peak, "matmul_flops": mm,
           "copy_bytes_s": bw, "active_params": totals.active_params, "stored_bytes": totals.text_bytes,
           "rows": rows}
    print(f"fp32 matmul {mm / 1e9:.1f} GFLOP/s, copy {bw / 1e9:.1f} GB/s, "
          f"{torch.get_num_threads()} threads, active params {totals.active_params / 1e6:.1f}M, "
          f"peak RSS {peak / 1e6:.0f} MB, tensor bytes {totals.text_bytes / 1e6:.0f} MB")
    print("| mode | dtype | prefill tok/s (T=%d) | bound | ratio | decode tok/s | bound | ratio |" % args.tokens)
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['dtype']} | {r['prefill_tok_s']:.1f} | {r['prefill_bound_tok_s']:.0f} | "
              f"{r['prefill_bound_tok_s'] / r['prefill_tok_s']:.1f}x | {r['decode_tok_s']:.2f} | "
              f"{r['decode_bound_tok_s']:.0f} | {r['decode_bound_tok_s'] / r['decode_tok_s']:.0f}x |")
    return res


# ---------------------------------------------------------------- gpu layers (full width)
class RandomLayer:
    """One layer's weights drawn on the device (synth-like scales) and MXFP4 experts kept packed."""

    def __init__(self, schema: Schema, layer: int, device, seed=0):
        g = torch.Generator(device=device).manual_seed(seed + layer)
        t = schema.text
        self.tensors, self.packed, self.nbytes, self.expert_bytes = {}, {}, 0, 0
        for role in schema.layer_roles(layer):
            shape = schema.logical_shape(role)
            if role.scope is Scope.EXPERT:
                (_, suffix_p, sp), (_, suffix_s, ss) = schema.stored(role)
                packed = torch.randint(0, 256, (t.num_experts, *sp), generator=g, device=device, dtype=torch.uint8)
                # E2M1 codes have rms ~2.9: scale 2^-7 gives weights of rms ~1/sqrt(3584)
                scale = torch.randint(119, 122, (t.num_experts, *ss), generator=g, device=device, dtype=torch.uint8)
                self.packed[role.role] = (packed, scale)
                self.expert_bytes += (math.prod(sp) + math.prod(ss))
                continue
            f32 = role.fmt is Format.F32
            x = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
            if role.role == "kda.A_log":
                x = torch.log(1 + 15 * torch.rand(shape, generator=g, device=device))
            elif len(shape) == 1 and role.role.endswith("norm"):
                x = 1 + 0.1 * x
            elif len(shape) >= 2:
                x = x / math.sqrt(math.prod(shape[1:]))
            else:
                x = 0.1 * x
            self.tensors[role.role] = x if f32 else x.to(torch.bfloat16)
            self.nbytes += x.numel() * (4 if f32 else 2)

    def weights(self, touched: set | None = None) -> LayerWeights:
        def expert(e):
            if touched is not None:
                touched.add(e)
            return {r: mxfp4.dequantize(p[e], s[e], torch.bfloat16) for r, (p, s) in self.packed.items()}
        return LayerWeights(0, self.tensors, expert if self.packed else None)


def gpu_layers(args) -> dict:
    dev = args.device
    cfg = load_config(args.config or release_config_path())
    schema, t = Schema(cfg), cfg.text
    la = t.linear_attn_config
    T, S, D = args.tokens, args.context, t.hidden_size
    big = torch.device(dev).type == "cuda"
    bw = copy_bandwidth(dev, (4 << 30) if big else (256 << 20))
    mm = matmul_rate(dev, torch.bfloat16, *((8192,) * 3 if big else (1024,) * 3))
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(T, D, generator=g, device=dev).to(torch.bfloat16)
    rows = []

    def row(name, secs, nbytes, flops):
        b = max(nbytes / H200_BW, flops / H200_BF16)
        bm = max(nbytes / bw, flops / mm)
        rows.append({"case": name, "ms": secs * 1e3, "bytes": nbytes, "flops": flops,
                     "bound_ms": b * 1e3, "measured_bound_ms": bm * 1e3})

    H, K = la.num_heads, la.head_dim
    # --- KDA layer (layer 1: KDA + MoE; its MoE part is timed below) ---
    lay = RandomLayer(schema, 1, dev)
    W = lay.weights()
    kda_params = sum(v.numel() for k, v in W.items() if k.startswith("kda.") and v.dim() == 2)
    kda_bytes = sum(v.numel() * v.element_size() for k, v in W.items() if k.startswith("kda."))
    zero = lambda: KDAState.zeros(H, K, K, la.short_conv_kernel_size, torch.float32, torch.bfloat16, dev)
    rec = H * 6 * K * K  # per token: S'ᵀk, k uᵀ, Sᵀq (2 FLOPs per multiply-add)
    row(f"KDA prefill T={T}", timed(lambda: kda.forward(x, W, zero(), t), dev),
        kda_bytes + 2 * T * D * 2, T * (2 * kda_params + rec))
    state = kda.forward(x, W, zero(), t).state
    row("KDA decode", timed(lambda: kda.forward(x[:1], W, state, t, decode=True), dev),
        kda_bytes + 2 * H * K * K * 4, 2 * kda_params + rec)
    # --- MoE layer: routed experts dequantized lazily, only the selected ones ---
    moe_params = sum(v.numel() for k, v in W.items() if k.startswith("moe.") and v.dim() == 2)
    moe_bytes = sum(v.numel() * v.element_size() for k, v in W.items() if k.startswith("moe."))
    per_expert = lay.expert_bytes
    expert_flops = 2 * 3 * t.moe_intermediate_size * t.routed_expert_hidden_size
    for n, name in ((T, f"MoE prefill T={T}"), (1, "MoE decode")):
        touched = set()
        Wt = lay.weights(touched)
        secs = timed(lambda: latent_moe.forward(x[:n], Wt, t), dev)
        row(name + f" ({len(touched)} experts)", secs, moe_bytes + len(touched) * per_expert,
            n * (2 * moe_params + t.num_experts_per_token * expert_flops))
        W0 = lay.weights()  # where the time goes: the lazy MXFP4 -> bf16 dequantization alone
        deq = timed(lambda: [W0.expert(e) for e in touched], dev)
        out_bytes = len(touched) * 3 * t.moe_intermediate_size * t.routed_expert_hidden_size * 2
        row(f"  of which dequantizing {len(touched)} experts", deq, len(touched) * per_expert + out_bytes, 0)
    del lay, W, Wt, state
    torch.cuda.empty_cache() if torch.device(dev).type == "cuda" else None
    # --- MLA layer (layer 3) ---
    lay = RandomLayer(schema, 3, dev)
    W = lay.weights()
    mla_params = sum(v.numel() for k, v in W.items() if k.startswith("mla.") and v.dim() == 2)
    mla_bytes = sum(v.numel() * v.element_size() for k, v in W.items() if k.startswith("mla."))
    Hm, N, R, V, L = (t.num_attention_heads, t.qk_nope_head_dim, t.qk_rope_head_dim, t.v_head_dim, t.kv_lora_rank)
    width = L + R

    def fresh():
        return MLAState.empty(width, torch.bfloat16, dev, capacity=S + 1)
    attn = Hm * (N + R + V) * T * T  # causal half of 2·T·T per head-dim
    row(f"MLA prefill T={T}", timed(lambda: mla.forward(x, W, fresh(), t), dev),
        mla_bytes + 2 * T * D * 2 + T * width * 2, 2 * T * mla_params + attn)
    st = fresh()
    st.append(torch.randn(S, width, generator=g, device=dev).to(torch.bfloat16))

    def decode_one():
        st.length = S  # re-use the same S-token context for every repetition
        return mla.forward(x[:1], W, st, t, absorbed=True)
    absorbed = 2 * Hm * (N * L + S * (L + R) + S * L + L * V)
    row(f"MLA decode S={S} (absorbed)", timed(decode_one, dev),
        mla_bytes + (S + 1) * width * 2, 2 * mla_params + absorbed)
    res = {"device": torch.cuda.get_device_name() if torch.device(dev).type == "cuda" else dev,
           "measured_copy_bytes_s": bw, "measured_bf16_flops": mm, "rows": rows}
    print(f"{res['device']}: measured copy {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s")
    print("| case | time ms | bytes | FLOPs | bound ms (4.8 TB/s, 990 TF) | x bound | measured-ceiling bound ms | x |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['ms']:.2f} | {r['bytes'] / 1e9:.2f} GB | {r['flops'] / 1e12:.2f} T | "
              f"{r['bound_ms']:.3f} | {r['ms'] / r['bound_ms']:.1f} | {r['measured_bound_ms']:.3f} | "
              f"{r['ms'] / r['measured_bound_ms']:.1f} |")
    return res


# ---------------------------------------------------------------- deviation per tap
def _kind(name: str) -> str:
    return name.split(".")[-1] if name.startswith("layers.") else name


def _run_taps(src, dtype, device, ids, prompt, forced=None):
    rec = TapRecorder()
    ex = Executor(SourceWeights(src, dtype=dtype, device=device, resident=True), rec, forced_routes=forced)
    _, cache = ex.prefill(ids[:prompt])
    for i in range(prompt, ids.shape[0]):
        ex.decode(int(ids[i]), cache)  # teacher-forced tokens: same positions in every run
    return rec


def compare(ref: TapRecorder, dev: TapRecorder) -> dict:
    out = {}
    for name in ref.names():
        a, b = ref[name], dev[name]
        if name.endswith("router_ids"):
            same = [len(set(x.tolist()) & set(y.tolist())) / len(x) for x, y in zip(a, b)]
            out[name] = {"set_agreement": sum(same) / len(same),
                         "exact_rows": sum(s == 1.0 for s in same) / len(same)}
            continue
        a, b = a.double(), b.double().to(a.device)
        m = {"rel_l2": ((b - a).norm() / a.norm()).item(), "max_abs": (b - a).abs().max().item(),
             "cos": torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()}
        if name == "logits":
            p, q = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
            kl = (p.exp() * (p - q)).sum(-1)
            m.update(kl_mean=kl.mean().item(), kl_max=kl.max().item(),
                     top1=(a.argmax(-1) == b.argmax(-1)).double().mean().item())
        out[name] = m
    return out


def deviation(args) -> dict:
    res = {}
    for src in args.source:
        vocab = load_config(src).text.vocab_size
        ids = torch.randint(0, vocab - 256, (args.prompt + args.decode,), generator=torch.Generator().manual_seed(7))
        t0 = time.perf_counter()
        ref = _run_taps(src, "float64", "cpu", ids, args.prompt)
        print(f"{src}: float64 reference on cpu in {time.perf_counter() - t0:.1f}s")
        forced = {n: ref[n] for n in ref.names() if n.endswith("router_ids")}
        for dtype in ("float32", "bfloat16"):
            for mode, f in (("free", None), ("forced-routing", forced)):
                key = f"{Path(src).name} {dtype} {args.device} {mode}"
                res[key] = compare(ref, _run_taps(src, dtype, args.device, ids, args.prompt, f))
    summary = {}
    for key, taps in res.items():
        kinds: dict[str, list] = {}
        for name, m in taps.items():
            kinds.setdefault(_kind(name), []).append((m.get("rel_l2", m.get("set_agreement")), name))
        summary[key] = {k: {"worst": max(v)[0] if k != "router_ids" else min(v)[0],
                            "at": (max(v) if k != "router_ids" else min(v))[1],
                            "median": statistics.median(x for x, _ in v)} for k, v in kinds.items()}
        summary[key]["logits"].update({k: taps["logits"][k] for k in ("kl_mean", "kl_max", "top1")})
    print("| run | " + " | ".join(["attn_res_out", "mixer_out", "ffn_out", "kda_state", "mla_latent",
                                   "final_hidden", "logits", "logits KL mean", "top-1", "router sets"]) + " |")
    print("|---" * 11 + "|")
    for key, s in summary.items():
        cells = [f"{s[k]['worst']:.2e}" for k in ("attn_res_out", "mixer_out", "ffn_out", "kda_state",
                                                   "mla_latent", "final_hidden", "logits")]
        cells += [f"{s['logits']['kl_mean']:.2e}", f"{s['logits']['top1']:.3f}",
                  f"{s['router_ids']['median']:.3f} (min {s['router_ids']['worst']:.3f})"]
        print(f"| {key} | " + " | ".join(cells) + " |")
    return {"prompt": args.prompt, "decode": args.decode, "summary": summary, "taps": res}


def ceilings(args) -> dict:
    res = {"matmul_flops": matmul_rate("cpu", torch.float32, args.m, args.k, args.n),
           "copy_bytes_s": copy_bandwidth("cpu", 256 << 20)}  # larger than any L3: DRAM bandwidth
    print(json.dumps(res))
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cpu")
    c.add_argument("--source", required=True)
    c.add_argument("--tokens", type=int, default=128)
    c.add_argument("--decode", type=int, default=8)
    c.add_argument("--dtype", default="float32")
    c.add_argument("--mode", choices=("streaming", "resident", "both"), default="both",
                   help="streaming re-reads each layer per call; resident keeps them (run apart for RSS)")
    gl = sub.add_parser("gpu-layers")
    gl.add_argument("--tokens", type=int, default=2048)
    gl.add_argument("--context", type=int, default=4096)
    gl.add_argument("--device", default="cuda")
    gl.add_argument("--config", type=Path, help="another config.json (default: full Kimi K3)")
    d = sub.add_parser("deviation")
    d.add_argument("--source", action="append", required=True)
    d.add_argument("--device", default="cuda")
    d.add_argument("--prompt", type=int, default=96)
    d.add_argument("--decode", type=int, default=4)
    ce = sub.add_parser("ceilings", help="fp32 matmul rate and copy bandwidth of this CPU (JSON)")
    for name in ("--m", "--k", "--n"):
        ce.add_argument(name, type=int, default=1024)
    for s in (c, gl, d):
        s.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    res = {"cpu": cpu, "gpu-layers": gpu_layers, "deviation": deviation, "ceilings": ceilings}[args.cmd](args)
    if getattr(args, "json", None):
        args.json.write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
