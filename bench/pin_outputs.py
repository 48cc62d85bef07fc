"""Record the behaviour pins of tests/test_pinned_outputs.py: every shipped layout's tiny bundle
and the goldens of the tiny checkpoint.

Usage: python bench/pin_outputs.py OUT_DIR [--goldens]  -> prints JSON {name: pin, ...}.
A bundle's pin is ``k3bundle.io.files.tree_digest`` of its folder; the goldens' pins are the
hash of their decisions (every integer array) and the float64 fingerprint of each case
(``k3bundle.golden.identity``), at one thread, readable forms.
Synthetic bytes are the same on every machine (docs/synthetic-models.md), so one set of pins
holds everywhere; record them again only when a change means to alter these outputs, and say
why in its commit.
"""
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(out: str, goldens: bool) -> dict:
    import torch
    torch.set_num_threads(1)
    from k3bundle.convert import convert
    from k3bundle.io.files import tree_digest
    from k3bundle.synth import write_synthetic

    out = Path(out)
    ckpt = out / "tiny"
    if not ckpt.exists():
        write_synthetic(ckpt, preset="tiny", seed=0)
    res = {"checkpoint:tiny": tree_digest(ckpt)}
    for name in sorted(p.stem for p in (REPO / "layouts").glob("*.yaml")):
        b = out / name
        if not b.exists():
            convert(ckpt, name, b, workers=1)
        res[name] = tree_digest(b)
    if goldens:
        from k3bundle.golden.generate import generate_goldens
        from k3bundle.golden.identity import decisions_hash, fingerprint
        from k3bundle.golden.store import read_npz

        g32, g64 = out / "g-float32", out / "g-float64"
        generate_goldens(ckpt, out=g32, long_tokens=256, forms="readable")
        generate_goldens(ckpt, out=g64, long_tokens=256, forms="readable", dtype="float64", noise=False)
        res["golden:decisions"] = decisions_hash(read_npz(g32 / "golden_inputs.npz"),
                                                 read_npz(g32 / "golden_intermediates.npz"))
        res["golden:float64-fingerprint"] = fingerprint(read_npz(g64 / "golden_intermediates.npz"))
    return res


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], "--goldens" in sys.argv), indent=1))
