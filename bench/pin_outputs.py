"""Digest of every shipped layout's tiny bundle and of the goldens (behaviour pin for refactors).

Usage: python bench/pin_outputs.py OUT_DIR [--goldens]  -> prints JSON {layout: digest, ...}.
The digest of a bundle is sha256 over (relative path, sha256 of bytes) of every file in it.
"""
import hashlib
import json
import sys
from pathlib import Path


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(root).as_posix().encode() + b"\0")
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


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
