"""Executor benchmarks (docs/performance.md "Executor", docs/executor.md "Deviations").

Four subcommands, each printing a Markdown table and, with ``--json FILE``, writing JSON:

``cpu``: prefill and decode tokens/s of the whole model on a synth checkpoint, streaming
(weights re-read per layer) and resident, against lower bounds measured in the same run:
prefill FLOPs at this machine's fp32 matmul rate, decode bytes at its copy bandwidth.

    /usr/bin/time -v python bench/executor.py cpu --source /tmp/k3-small --tokens 128 --decode 8 --mode streaming

``gpu-layers``: one KDA, one MLA and one MoE layer at full Kimi K3 width (random weights made
on the device, 896 MXFP4 experts kept packed and dequantized when routed), bf16 and float32
policies, the executor's fast forms (and its readable ones at the shortest prefill), prefill
and decode, against max(bytes / HBM bandwidth, FLOPs / the policy's peak), with the datasheet
H200 peaks (4.8 TB/s; 990 TFLOP/s bf16, 67 TFLOP/s FP32) and the ceilings measured in the same
run; peak GPU memory per row.

    python bench/executor.py gpu-layers --tokens 2048 8192 --context 4096 131072

``deviation``: taps of float32 and bfloat16 runs on a device against CPU float64, free-running
and with routing teacher-forced from the float64 run.

``forms``: the executor's fast forms against its readable ones, per tap kind, in float64, float32
and bfloat16 on a device (docs/executor.md "Forms").

    python bench/executor.py forms --source /tmp/k3-tiny --source /tmp/k3-small --device cuda

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
from k3bundle.ops.expert_weight import ExpertWeight  # noqa: E402
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
def draw_tensor(role, shape, g, device) -> torch.Tensor:
    """A synth-like random value of a non-expert role, FP32 (callers cast to the role's dtype)."""
    x = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
    if role.role == "kda.A_log":
        return torch.log(1 + 15 * torch.rand(shape, generator=g, device=device))
    if len(shape) == 1 and role.role.endswith("norm"):
        return 1 + 0.1 * x
    if len(shape) >= 2 and role.role != "embed":
        return x / math.sqrt(math.prod(shape[1:]))
    return 0.1 * x


def draw_experts(schema: Schema, role, g, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert of ``role`` as random MXFP4: packed codes and scales [E, ...] uint8."""
    (_, _, sp), (_, _, ss) = schema.stored(role)
    n = schema.text.num_experts
    packed = torch.randint(0, 256, (n, *sp), generator=g, device=device, dtype=torch.uint8)
    # E2M1 codes have rms ~2.9: scale 2^-7 gives weights of rms ~1/sqrt(3584)
    scale = torch.randint(119, 122, (n, *ss), generator=g, device=device, dtype=torch.uint8)
    return packed, scale


class RandomLayer:
    """One layer's weights drawn on the device (synth-like scales) in the policy's dtypes, MXFP4
    experts kept packed [E, ...] and dequantized by the codec when routed."""

    def __init__(self, schema: Schema, layer: int, device, dtype=torch.bfloat16, seed=0):
        g = torch.Generator(device=device).manual_seed(seed + layer)
        self.dtype, self.tensors, self.packed, self.nbytes, self.expert_bytes = dtype, {}, {}, 0, 0
        for role in schema.layer_roles(layer):
            if role.scope is Scope.EXPERT:
                packed, scale = self.packed[role.role] = draw_experts(schema, role, g, device)
                self.expert_bytes += (packed[0].numel() + scale[0].numel())
                continue
            f32 = role.fmt is Format.F32
            x = draw_tensor(role, schema.logical_shape(role), g, device)
            # the policy's weight dtype (F32 roles stay F32): bf16 -> bf16, float32 -> f32
            x = x if f32 else x.to(torch.bfloat16).to(dtype)
            self.tensors[role.role] = x
            self.nbytes += x.numel() * x.element_size()

    def weights(self, touched: set | None = None) -> LayerWeights:
        def expert(e):  # as SourceWeights hands them over: stored MXFP4, decoded on demand
            if touched is not None:
                touched.add(e)
            return {r: ExpertWeight(lambda p=p[e], s=s[e]: mxfp4.dequantize(p, s, self.dtype), (p[e], s[e]))
                    for r, (p, s) in self.packed.items()}
        return LayerWeights(0, self.tensors, expert if self.packed else None)


#: datasheet peaks of one H200 per policy: bf16 tensor cores (dense), FP32 without TF32
PEAK_FLOPS = {"bfloat16": 990e12, "float32": 67e12}


def gpu_layers(args) -> dict:
    dev = args.device
    cfg = load_config(args.config or release_config_path())
    schema, t = Schema(cfg), cfg.text
    la = t.linear_attn_config
    D, H, K = t.hidden_size, la.num_heads, la.head_dim
    big = torch.device(dev).type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False  # exact FP32, as goldens run
    bw = copy_bandwidth(dev, (4 << 30) if big else (256 << 20))
    measured = {"bfloat16": matmul_rate(dev, torch.bfloat16, *((8192,) * 3 if big else (1024,) * 3)),
                "float32": matmul_rate(dev, torch.float32, *((8192,) * 3 if big else (1024,) * 3))}
    g = torch.Generator(device=dev).manual_seed(1)
    rows = []
    peak = lambda: torch.cuda.max_memory_allocated() if big else 0  # noqa: E731

    def reset_peak():
        if big:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def row(policy, form, name, fn, nbytes, flops, reps=3):
        reset_peak()
        secs = timed(fn, dev, reps=reps, warmup=1 if reps > 1 else 0)
        b = max(nbytes / H200_BW, flops / PEAK_FLOPS[policy])
        bm = max(nbytes / bw, flops / measured[policy])
        rows.append({"policy": policy, "form": form, "case": name, "ms": secs * 1e3, "bytes": nbytes, "flops": flops,
                     "bound_ms": b * 1e3, "measured_bound_ms": bm * 1e3, "peak_gb": peak() / 1e9})
        print(f"  {policy} {form} {name}: {secs * 1e3:.2f} ms ({secs / b:.1f}x bound)", flush=True)

    for policy in args.policy:
        dt = getattr(torch, policy)
        esize = torch.empty(0, dtype=dt).element_size()
        xs = {T: torch.randn(T, D, generator=g, device=dev).to(torch.bfloat16).to(dt) for T in args.tokens}
        T0 = min(args.tokens)
        # --- KDA (layer 1; its MoE part is timed below) ---
        lay = RandomLayer(schema, next(l for l in t.kda_layers if t.is_moe(l)), dev, dt)  # 1 in the release
        W = lay.weights()
        kda_params = sum(v.numel() for k, v in W.items() if k.startswith("kda.") and v.dim() == 2)
        kda_bytes = sum(v.numel() * v.element_size() for k, v in W.items() if k.startswith("kda."))
        st_dt = torch.float64 if dt == torch.float64 else torch.float32
        zero = lambda: KDAState.zeros(H, K, K, la.short_conv_kernel_size, st_dt, dt, dev)  # noqa: E731
        rec = H * 6 * K * K  # per token: S'ᵀk, k uᵀ, Sᵀq (2 FLOPs per multiply-add)
        for T in args.tokens:
            for form in ("fast", "readable") if T == T0 else ("fast",):
                row(policy, form, f"KDA prefill T={T}",
                    lambda: kda.forward(xs[T], W, zero(), t, fast=form == "fast"),
                    kda_bytes + 2 * T * D * esize, T * (2 * kda_params + rec))
        state = kda.forward(xs[T0], W, zero(), t).state
        row(policy, "fast", "KDA decode", lambda: kda.forward(xs[T0][:1], W, state, t, decode=True),
            kda_bytes + 2 * H * K * K * 4, 2 * kda_params + rec)
        # --- MoE: routed experts dequantized when routed (the Triton codec on CUDA) ---
        moe_params = sum(v.numel() for k, v in W.items() if k.startswith("moe.") and v.dim() == 2)
        moe_bytes = sum(v.numel() * v.element_size() for k, v in W.items() if k.startswith("moe."))
        per_expert = lay.expert_bytes
        expert_flops = 2 * 3 * t.moe_intermediate_size * t.routed_expert_hidden_size
        cases = [(T, f"MoE prefill T={T}", ("fast", "readable") if T == T0 else ("fast",)) for T in args.tokens]
        for n, name, forms in cases + [(1, "MoE decode", ("fast", "readable"))]:
            for form in forms:
                touched = set()
                Wt = lay.weights(touched)
                row(policy, form, name, lambda: latent_moe.forward(xs[T0][:n] if n == 1 else xs[n], Wt, t,
                                                                     fast=form == "fast"),
                    moe_bytes + 0, n * (2 * moe_params + t.num_experts_per_token * expert_flops))
                rows[-1]["bytes"] += len(touched) * per_expert  # the experts actually routed
                rows[-1]["case"] += f" ({len(touched)} experts)"
                b = max(rows[-1]["bytes"] / H200_BW, rows[-1]["flops"] / PEAK_FLOPS[policy])
                rows[-1]["bound_ms"] = b * 1e3
                rows[-1]["measured_bound_ms"] = max(rows[-1]["bytes"] / bw, rows[-1]["flops"] / measured[policy]) * 1e3
            # the codec alone: the touched experts' MXFP4 -> policy dtype, as the fast form does it
            # (one launch per projection into a stacked buffer) and one expert at a time (readable)
            ids = sorted(touched)
            shape = {r: (len(ids), p.shape[1], p.shape[2] * 2) for r, (p, _) in lay.packed.items()}
            stacks = {r: torch.empty(sh, dtype=dt, device=dev) for r, sh in shape.items()}
            out_bytes = len(ids) * 3 * t.moe_intermediate_size * t.routed_expert_hidden_size * esize

            def stacked():
                for r, (p, s) in lay.packed.items():
                    mxfp4.dequantize_stack([p[e] for e in ids], [s[e] for e in ids], stacks[r])
            row(policy, "fast", f"  of which decoding {len(ids)} experts (MXFP4 codec, stacked)", stacked,
                len(ids) * per_expert + out_bytes, 0)
            rows[-1]["packed_gb_s"] = len(ids) * per_expert / (rows[-1]["ms"] / 1e3) / 1e9
            stacks = None  # free before the next row
            if n == 1 and big:  # a decode step: the projections read MXFP4 directly (fused, nothing written)
                zs = {"moe.expert.w1": torch.randn(len(ids), 1, t.routed_expert_hidden_size, device=dev).to(dt),
                      "moe.expert.w2": torch.randn(len(ids), 1, t.moe_intermediate_size, device=dev).to(dt)}
                zs["moe.expert.w3"] = zs["moe.expert.w1"]

                def direct():
                    for r, (p, s) in lay.packed.items():
                        mxfp4.matmul_stack(zs[r], [p[e] for e in ids], [s[e] for e in ids])
                row(policy, "fast", f"  of which the {len(ids)} experts' 3 projections reading MXFP4 directly",
                    direct, len(ids) * per_expert, 0)
                rows[-1]["packed_gb_s"] = len(ids) * per_expert / (rows[-1]["ms"] / 1e3) / 1e9
            W0 = lay.weights()
            row(policy, "readable", f"  of which decoding {len(ids)} experts (MXFP4 codec, one at a time)",
                lambda: [[w.value() for w in W0.stored_expert(e).values()] for e in ids],
                len(ids) * per_expert + out_bytes, 0)
            rows[-1]["packed_gb_s"] = len(ids) * per_expert / (rows[-1]["ms"] / 1e3) / 1e9
        lay = W = Wt = W0 = state = None  # free the layer before the next
        torch.cuda.empty_cache() if big else None
        # --- MLA (layer 4 in the release: the first full-attention layer) ---
        lay = RandomLayer(schema, next(l for l in range(t.num_hidden_layers) if t.is_mla(l)), dev, dt)
        W = lay.weights()
        del lay.packed  # its experts are not needed here
        mla_params = sum(v.numel() for k, v in W.items() if k.startswith("mla.") and v.dim() == 2)
        mla_bytes = sum(v.numel() * v.element_size() for k, v in W.items() if k.startswith("mla."))
        Hm, N, R, V, L = (t.num_attention_heads, t.qk_nope_head_dim, t.qk_rope_head_dim, t.v_head_dim, t.kv_lora_rank)
        width = L + R
        for T in [*args.tokens, *args.mla_tokens]:
            x = xs[T] if T in xs else torch.randn(T, D, generator=g, device=dev).to(torch.bfloat16).to(dt)
            fresh = lambda T=T: MLAState.empty(width, dt, dev, capacity=T + 1)  # noqa: E731
            attn = Hm * (N + R + V) * T * T  # causal half of 2·T·T per head-dim
            for form in ("fast", "readable") if T == T0 else ("fast",):
                row(policy, form, f"MLA prefill T={T}", lambda: mla.forward(x, W, fresh(), t, fast=form == "fast"),
                    mla_bytes + 2 * T * D * esize + T * width * esize, 2 * T * mla_params + attn,
                    reps=1 if T > 16384 else 3)
            x = None
        for S in args.context:
            st = MLAState.empty(width, dt, dev, capacity=S + 1)
            st.append(torch.randn(S, width, generator=g, device=dev).to(dt))

            def decode_one(st=st, S=S):
                st.length = S  # re-use the same S-token context for every repetition
                return mla.forward(xs[T0][:1], W, st, t, absorbed=True)
            absorbed = 2 * Hm * (N * L + S * (L + R) + S * L + L * V)
            row(policy, "fast", f"MLA decode S={S} (absorbed)", decode_one,
                mla_bytes + (S + 1) * width * esize, 2 * mla_params + absorbed)
            st = None
        lay = W = xs = None
        torch.cuda.empty_cache() if big else None
    res = {"device": torch.cuda.get_device_name() if big else dev, "torch": torch.__version__,
           "measured_copy_bytes_s": bw, "measured_matmul_flops": measured, "rows": rows}
    print(f"{res['device']}: measured copy {bw / 1e12:.2f} TB/s, bf16 matmul {measured['bfloat16'] / 1e12:.0f} "
          f"TFLOP/s, fp32 matmul {measured['float32'] / 1e12:.1f} TFLOP/s")
    print("| policy | form | case | time ms | bytes | FLOPs | bound ms | x bound | measured-ceiling bound ms | x | "
          "peak GPU GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        extra = f" ({r['packed_gb_s']:.0f} GB/s packed)" if "packed_gb_s" in r else ""
        print(f"| {r['policy']} | {r['form']} | {r['case']}{extra} | {r['ms']:.2f} | {r['bytes'] / 1e9:.2f} GB | "
              f"{r['flops'] / 1e12:.2f} T | {r['bound_ms']:.3f} | {r['ms'] / r['bound_ms']:.1f} | "
              f"{r['measured_bound_ms']:.3f} | {r['ms'] / r['measured_bound_ms']:.1f} | {r['peak_gb']:.1f} |")
    return res


# ---------------------------------------------------------------- deviation per tap
def _kind(name: str) -> str:
    return name.split(".")[-1] if name.startswith("layers.") else name


def _run_taps(src, dtype, device, ids, prompt, forced=None, forms="fast"):
    rec = TapRecorder()
    ex = Executor(SourceWeights(src, dtype=dtype, device=device, resident=True), rec, forced_routes=forced, forms=forms)
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


def forms(args) -> dict:
    """Per tap kind: the fast forms against the readable ones (same dtype, same device, routing
    teacher-forced from the float64 run), and each against CPU float64 readable."""
    res = {}
    for src in args.source:
        vocab = load_config(src).text.vocab_size
        ids = torch.randint(0, vocab - 256, (args.prompt + args.decode,), generator=torch.Generator().manual_seed(7))
        ref = _run_taps(src, "float64", "cpu", ids, args.prompt, forms="readable")
        forced = {n: ref[n] for n in ref.names() if n.endswith("router_ids")}
        for dtype in ("float64", "float32", "bfloat16"):
            runs = {f: _run_taps(src, dtype, args.device, ids, args.prompt, forced, forms=f) for f in ("readable", "fast")}
            pairs = {"fast vs readable": (runs["readable"], runs["fast"]), "readable vs f64": (ref, runs["readable"]),
                     "fast vs f64": (ref, runs["fast"])}
            for what, (a, b) in pairs.items():
                kinds: dict[str, float] = {}
                for name, m in compare(a, b).items():
                    if "rel_l2" in m:
                        kinds[_kind(name)] = max(kinds.get(_kind(name), 0.0), m["rel_l2"])
                res[f"{Path(src).name} {dtype} {args.device} {what}"] = kinds
    cols = ["attn_res_out", "mixer_out", "ffn_out", "kda_state", "mla_latent", "final_hidden", "logits"]
    print("| run | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for key, kinds in res.items():
        print(f"| {key} | " + " | ".join(f"{kinds.get(c, float('nan')):.1e}" for c in cols) + " |")
    return res


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
    gl.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192], help="prefill lengths")
    gl.add_argument("--context", type=int, nargs="+", default=[4096, 131072], help="MLA decode contexts")
    gl.add_argument("--policy", nargs="+", default=["bfloat16", "float32"], choices=("bfloat16", "float32"))
    gl.add_argument("--mla-tokens", type=int, nargs="*", default=[], help="extra MLA prefill lengths (long contexts)")
    gl.add_argument("--device", default="cuda")
    gl.add_argument("--config", type=Path, help="another config.json (default: full Kimi K3)")
    d = sub.add_parser("deviation")
    d.add_argument("--source", action="append", required=True)
    d.add_argument("--device", default="cuda")
    d.add_argument("--prompt", type=int, default=96)
    d.add_argument("--decode", type=int, default=4)
    fo = sub.add_parser("forms", help="the fast forms against the readable ones, worst rel. L2 per tap kind")
    fo.add_argument("--source", action="append", required=True)
    fo.add_argument("--device", default="cpu")
    fo.add_argument("--prompt", type=int, default=200)
    fo.add_argument("--decode", type=int, default=4)
    ce = sub.add_parser("ceilings", help="fp32 matmul rate and copy bandwidth of this CPU (JSON)")
    for name in ("--m", "--k", "--n"):
        ce.add_argument(name, type=int, default=1024)
    for s in (c, gl, d, fo):
        s.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    res = {"cpu": cpu, "gpu-layers": gpu_layers, "deviation": deviation, "forms": forms,
           "ceilings": ceilings}[args.cmd](args)
    if getattr(args, "json", None):
        args.json.write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
