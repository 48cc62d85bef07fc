"""Goldens at the release's full width on one GPU: every shipped case through the golden pipeline.

    python bench/golden_full_width.py --layers 1 5 --long-tokens 32768 --json out.json

A reduced-depth Kimi K3 with the release's shapes (hidden 7168, 96 KDA / MLA heads, 896 MXFP4
experts top-16, vocabulary 163,840): ``--layers 5`` is layers 0-4 of the release (dense KDA layer
0, KDA MoE layers 1, 2 and 4, MLA MoE layer 3: the release's 3:1 KDA:MLA mix), weights drawn on
the device (no checkpoint on disk: 63 GB of packed experts). Each case runs as ``k3bundle golden``
runs it (``golden.generate.case_arrays``: float32, the fast forms, greedy steps, every expert
choice, KDA chunk states) and then its BF16 noise replay (``golden.noise.noise_arrays``), timed
per case, with the GPU's peak memory. The long-context case is ``--long-tokens`` long.

Two depths in one run (``--layers 1 5``) give the per-4-layer cost from which the 93-layer
time is projected (docs/performance.md "Goldens at full width"): t93 = t1 + 23 · (t5 − t1).
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from executor import draw_experts, draw_tensor  # noqa: E402  (bench/executor.py: one way to draw weights)
from k3bundle.config import parse_config  # noqa: E402
from k3bundle.executor.weights import LayerWeights, WeightSource, policy  # noqa: E402
from k3bundle.formats import mxfp4  # noqa: E402
from k3bundle.golden.cases import load_cases  # noqa: E402
from k3bundle.golden.generate import case_arrays  # noqa: E402
from k3bundle.golden.noise import noise_arrays  # noqa: E402
from k3bundle.ops.expert_weight import ExpertWeight  # noqa: E402
from k3bundle.schema import Format, Schema, Scope  # noqa: E402
from k3bundle.presets import mla_layers_1based, release_config_dict  # noqa: E402
from k3bundle.tokenizer import load_tiktoken  # noqa: E402


CUDA = torch.cuda.is_available()


def sync():
    if CUDA:
        torch.cuda.synchronize()


def reduced_config(layers: int, base: Path | None = None):
    """The release config (or ``base``) at ``layers`` decoder layers (every width and the expert count kept)."""
    cfg = copy.deepcopy(json.loads(base.read_text()) if base else release_config_dict())
    t = cfg["text_config"]
    t["num_hidden_layers"] = layers
    full = mla_layers_1based(layers)
    t["linear_attn_config"]["full_attn_layers"] = full
    t["linear_attn_config"]["kda_layers"] = [i for i in range(1, layers + 1) if i not in full]
    return parse_config(cfg, f"release@{layers} layers")


class DeviceWeights(WeightSource):
    """Random release-shaped weights made on the device: BF16-valued tensors (F32 roles as F32),
    MXFP4 experts as packed bytes and scales; a BF16 twin shares the packed experts."""

    def __init__(self, config, device, dtype="float32", seed=0, share=None):
        self.config, self.device, self.policy = config, torch.device(device), policy(dtype)
        self.schema = Schema(config)
        t = config.text
        if share is not None:  # the same values in another dtype policy
            self.packed = share.packed
            self.tensors = {k: self._cast(v, f32) for k, (v, f32) in share.raw.items()}
            return
        g = torch.Generator(device=self.device).manual_seed(seed)
        self.raw, self.packed = {}, {}
        specs = [(r, None) for r in {s.role.role: s.role for s in self.schema.global_tensors()}.values()]
        specs += [(r, l) for l in range(t.num_hidden_layers) for r in self.schema.layer_roles(l)]
        for role, layer in specs:
            if role.scope is Scope.EXPERT:
                self.packed[(role.role, layer)] = draw_experts(self.schema, role, g, self.device)
                continue
            f32 = role.fmt is Format.F32
            x = draw_tensor(role, self.schema.logical_shape(role), g, self.device)
            self.raw[(role.role, layer)] = (x if f32 else x.to(torch.bfloat16), f32)
        self.tensors = {k: self._cast(v, f32) for k, (v, f32) in self.raw.items()}

    def _cast(self, x, f32):
        return x.to(self.policy.f32 if f32 else self.policy.weight)

    def layer(self, layer, decode=False):
        roles = [r.role for r in self.schema.layer_roles(layer) if r.scope is not Scope.EXPERT]
        tensors = {r: self.tensors[(r, layer)] for r in roles}
        if not self.config.text.is_moe(layer):
            return LayerWeights(layer, tensors)
        dt, block = self.policy.weight, self.config.text.mxfp4_group

        def expert(e):  # as SourceWeights hands them over: stored MXFP4, decoded on demand
            out = {}
            for r in ("moe.expert.w1", "moe.expert.w2", "moe.expert.w3"):
                p, s = (x[e] for x in self.packed[(r, layer)])
                out[r] = ExpertWeight(lambda p=p, s=s: mxfp4.dequantize(p, s, dt, block=block), (p, s))
            return out
        return LayerWeights(layer, tensors, expert)

    def embed(self, ids):
        return self.tensors[("embed", None)][ids.to(self.device)].to(self.policy.act)

    def global_tensor(self, role):
        return self.tensors[(role, None)]


def tokenizer(tmp: Path):
    """The synthetic tokenizer (synth's tiny checkpoint): ids for the cases, below any vocabulary."""
    subprocess.run([sys.executable, "-m", "k3bundle", "synth", "--preset", "tiny", "--out", str(tmp / "tok")],
                   check=True, capture_output=True)
    return load_tiktoken(tmp / "tok")


def run(layers: int, args, encoding) -> dict:
    torch.cuda.empty_cache() if CUDA else None
    cfg = reduced_config(layers, args.config)
    t0 = time.perf_counter()
    w32 = DeviceWeights(cfg, args.device, "float32")
    w16 = DeviceWeights(cfg, args.device, "bfloat16", share=w32) if args.noise else None
    sync()
    made = time.perf_counter() - t0
    weight_bytes = sum(x.numel() * x.element_size() for d in (w32.tensors, *(() if w16 is None else (w16.tensors,)))
                       for x in d.values()) + sum(p.numel() + s.numel() for p, s in w32.packed.values())
    print(f"{layers} layers: weights made on the device in {made:.1f} s, {weight_bytes / 1e9:.1f} GB", flush=True)
    first = next(c for c in load_cases() if c.runnable)  # warm-up: Triton compiles its kernels once
    ids = first.build_ids(encoding)
    arrays = case_arrays(w32, first, ids)
    if w16 is not None:
        noise_arrays(w16, arrays, ids)
    cases = []
    for case in load_cases():
        if not case.runnable or (args.cases and case.name not in args.cases):
            continue
        ids = case.build_ids(encoding, args.long_tokens if case.kind == "long_context" else None)
        sync()
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            arrays = case_arrays(w32, case, ids)
            sync()
            t1 = time.perf_counter()
            if w16 is not None:
                noise_arrays(w16, arrays, ids)
            sync()
            t2 = time.perf_counter()
        except torch.OutOfMemoryError as e:
            cases.append({"case": case.name, "tokens": len(ids), "error": f"out of memory: {str(e)[:200]}"})
            print(f"  {case.name}: out of memory", flush=True)
            torch.cuda.empty_cache()
            continue
        row = {"case": case.name, "kind": case.kind, "tokens": len(ids), "steps": case.steps,
               "golden_s": round(t1 - t0, 3), "noise_s": round(t2 - t1, 3),
               "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9 if CUDA else 0, 2)}
        cases.append(row)
        print(f"  {case.name:<13} {len(ids):>6} tokens {case.steps:>3} steps: golden {row['golden_s']:.2f} s, "
              f"noise {row['noise_s']:.2f} s, peak {row['peak_gpu_gb']:.1f} GB", flush=True)
        del arrays
    del w32, w16
    return {"layers": layers, "weights_made_s": round(made, 1), "weight_bytes": weight_bytes, "cases": cases}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[1, 5])
    p.add_argument("--long-tokens", type=int, default=32768)
    p.add_argument("--device", default="cuda")
    p.add_argument("--cases", nargs="*", help="a subset of the shipped cases (default: all)")
    p.add_argument("--no-noise", dest="noise", action="store_false", help="skip the BF16 noise replays")
    p.add_argument("--config", type=Path, help="another config.json to reduce (default: the release's)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False  # goldens are exact FP32
    with tempfile.TemporaryDirectory() as tmp:
        encoding = tokenizer(Path(tmp))
    res = {"device": torch.cuda.get_device_name() if CUDA else "cpu", "torch": torch.__version__, "long_tokens": args.long_tokens,
           "runs": [run(n, args, encoding) for n in args.layers]}
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
