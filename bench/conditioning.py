"""How well-conditioned a synthetic model is: random ``tiny`` against ``tiny-trained``.

    python bench/conditioning.py --source /tmp/k3-tiny --source /tmp/k3-tiny-trained --json out.json

For each checkpoint and each prompt (the golden cases' plain prompt, two rendered chats and
held-out prose and code, 100-300 tokens each), the prefill runs free (each precision routes for
itself) under the float32 policy (the golden) and the bfloat16 policy (device emulation):

- logits NMSE  = Σ(bf16 − f32)² / Σ f32², and top-1 agreement, over every prompt position;
- routing flips per MoE layer: the fraction of tokens whose set of top-k experts differs;
- the float32 run's selection margin (R2: k-th minus (k+1)-th biased score) per layer:
  median and the fraction of tokens under 1e-3 and 1e-2 (near ties, where bf16 noise flips);
- greedy continuation of the plain prompt (16 tokens), float32, decoded.

Prints a Markdown table (docs/synthetic-models.md "Conditioning").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3bundle.chat.render import render_ids  # noqa: E402
from k3bundle.executor import Executor  # noqa: E402
from k3bundle.executor.taps import TapRecorder  # noqa: E402
from k3bundle.executor.weights import SourceWeights  # noqa: E402
from k3bundle.tokenizer import load_tiktoken  # noqa: E402

PLAIN = ("The converter reads each source tensor once, hashes it, and writes the device shards in a "
         "fixed order so that")
PROSE = ("A bring-up engineer compares every layer of the new device against a reference. When the "
         "hidden state drifts, the first layer whose error grows more than the others is where the "
         "fault lives, and the report names that layer, the tap and the size of the error so that "
         "the kernel owner can reproduce it on one card without the rest of the model.")
CODE = ('import json\nfrom pathlib import Path\n\n\ndef load_manifest(path):\n    """Read a manifest '
        'and return its tensors by name."""\n    data = json.loads(Path(path).read_text())\n    out = {}\n'
        '    for entry in data["tensors"]:\n        out[entry["name"]] = entry\n    return out\n')
CHATS = [
    [{"role": "user", "content": "Name one reason to keep MXFP4 bytes bit-exact during conversion."}],
    [{"role": "user", "content": "How much memory is free on GPU 3, in GiB?"},
     {"role": "assistant", "reasoning_content": "I should check the device.", "content": "Let me look."},
     {"role": "user", "content": "Please also say how much is reserved."}],
]


def prompts(enc) -> dict[str, list[int]]:
    out = {"plain": enc.encode(PLAIN), "prose": enc.encode(PROSE), "code": enc.encode(CODE)}
    for i, msgs in enumerate(CHATS):
        out[f"chat{i}"] = render_ids(msgs, enc)
    return out


def run(source: str, ids: list[int], dtype: str):
    rec = TapRecorder(["layers.*.router_ids", "layers.*.router_margin"])
    ex = Executor(SourceWeights(source, dtype, resident=True), taps=rec)
    logits, _ = ex.prefill(ids)
    return logits.float(), rec


def measure(source: str) -> dict:
    enc = load_tiktoken(source)
    num = den = agree = total = 0.0
    flips: dict[str, list[float]] = {}
    margins: dict[str, list[float]] = {}
    for ids in prompts(enc).values():
        f32, r32 = run(source, ids, "float32")
        b16, r16 = run(source, ids, "bfloat16")
        num += float(((b16 - f32) ** 2).sum())
        den += float((f32 ** 2).sum())
        agree += float((b16.argmax(-1) == f32.argmax(-1)).sum())
        total += f32.shape[0]
        for name in r32.names():
            if name.endswith("router_ids"):
                a, b = r32[name].sort(-1).values, r16[name].sort(-1).values
                flips.setdefault(name, []).extend((a != b).any(-1).float().tolist())
            else:
                margins.setdefault(name, []).extend(r32[name].tolist())
    all_m = [m for v in margins.values() for m in v]
    ex = Executor(SourceWeights(source, "float32", resident=True))
    cont = ex.generate(enc.encode(PLAIN), 16).tokens
    return {
        "source": source, "tokens": int(total),
        "logits_nmse": num / den, "top1": agree / total,
        "flips_per_layer": {k.split(".")[1]: statistics.fmean(v) for k, v in flips.items()},
        "flip_rate": statistics.fmean([x for v in flips.values() for x in v]),
        "margin_median": statistics.median(all_m),
        "margin_lt_1e-3": sum(m < 1e-3 for m in all_m) / len(all_m),
        "margin_lt_1e-2": sum(m < 1e-2 for m in all_m) / len(all_m),
        "margin_median_per_layer": {k.split(".")[1]: statistics.median(v) for k, v in margins.items()},
        "greedy": enc.decode(cont),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", action="append", required=True)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    rows = [measure(s) for s in args.source]
    print("| checkpoint | tokens | bf16 vs f32 logits NMSE | top-1 agreement | routing flips (all layers) "
          "| flips per layer | median margin | margins < 1e-3 | < 1e-2 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        per = " ".join(f"{v:.2f}" for v in r["flips_per_layer"].values())
        print(f"| {Path(r['source']).name} | {r['tokens']} | {r['logits_nmse']:.2e} | {r['top1']:.3f} | "
              f"{r['flip_rate']:.3f} | {per} | {r['margin_median']:.2e} | {r['margin_lt_1e-3']:.3f} | "
              f"{r['margin_lt_1e-2']:.3f} |")
    for r in rows:
        print(f"\n{Path(r['source']).name} greedy: {r['greedy']!r}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
