"""What of the tiny checkpoint's goldens this machine reproduces: content hash, decisions, fingerprint.

    python bench/golden_hash.py

prints JSON: for ``synth --preset tiny --seed 0`` and goldens at one thread (long context 256
tokens, the readable forms, as tests/test_pinned_outputs.py makes them), the float32 goldens' full
content hash (not pinned: it follows the CPU's GEMM summation order), the decisions hash and the
float64 fingerprint (both pinned), with the machine's processor. Compare two machines' output.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from synth_digest import cpu_name


def main() -> None:
    from k3bundle import runtime

    runtime.apply()
    import torch

    from k3bundle.golden.generate import generate_goldens
    from k3bundle.golden.identity import decisions_hash, fingerprint
    from k3bundle.golden.store import META_KEY, content_hash, read_npz
    from k3bundle.synth import write_synthetic

    torch.set_num_threads(1)
    report: dict = {"machine": cpu_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_synthetic(Path(tmp) / "tiny", preset="tiny", seed=0, force=True).out
        for dtype in ("float32", "float64"):
            out = Path(tmp) / dtype
            generate_goldens(ckpt, out=out, long_tokens=256, forms="readable", dtype=dtype, noise=dtype == "float32")
            inputs, inter = read_npz(out / "golden_inputs.npz"), read_npz(out / "golden_intermediates.npz")
            inter.pop(META_KEY, None)  # the run's record (times, versions), not its values
            floats = {k: v for k, v in inter.items() if v.dtype.kind == "f" and ".added." not in k}
            report[dtype] = {"content_hash": content_hash(inter), "float_arrays_hash": content_hash(floats),
                             "decisions": decisions_hash(inputs, inter)}
            if dtype == "float64":
                report[dtype]["fingerprint"] = fingerprint(inter)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
