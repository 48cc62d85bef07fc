"""Digest of every shipped layout's tiny bundle and of the goldens (behaviour pin for refactors).

Usage: python bench/pin_outputs.py OUT_DIR [--goldens]  -> prints JSON {layout: digest, ...}.
On a machine class whose bytes differ (tests/test_pinned_outputs.py says why), record its set as a new class.
The digest of a bundle is sha256 over (relative path, sha256 of bytes) of every file in it.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.test_pinned_outputs import tree_digest  # noqa: E402  (one definition of the digest)


def main(out: str, goldens: bool) -> dict:
    import torch
    torch.set_num_threads(1)
    from k3bundle.convert import convert
    from k3bundle.synth import write_synthetic

    out = Path(out)
    ckpt = out / "tiny"
    if not ckpt.exists():
        write_synthetic(ckpt, preset="tiny", seed=0)
    res = {}
    layouts = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "layouts").glob("*.yaml"))
    for name in layouts:
        b = out / name
        if not b.exists():
            convert(ckpt, name, b, workers=1)
        res[name] = tree_digest(b)
    if goldens:
        from k3bundle.golden.generate import generate_goldens
        res["golden:checkpoint"] = generate_goldens(ckpt, out=out / "g-ckpt", long_tokens=256).content_hash
        res["golden:b300-tp8"] = generate_goldens(out / "b300-tp8", out=out / "g-b300", long_tokens=256).content_hash
    return res


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], "--goldens" in sys.argv), indent=1))
