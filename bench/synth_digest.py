"""Digests of synthetic checkpoints, to compare two machines: same code, same bytes?

    python bench/synth_digest.py [--small] [--out DIR]

prints JSON: the ``tree_digest`` (sha256 over every file's relative path and sha256) of
``synth --preset tiny --seed 0`` and, with ``--small``, of ``synth --preset small --seed 0``
(about 1 GB), with the machine's processor, numpy and torch versions. Run it on two machines
and compare the digests (docs/synthetic-models.md "Identical on every machine").
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="also the ~1 GB small preset")
    ap.add_argument("--out", type=Path, help="where to write the checkpoints (default: a temporary folder)")
    args = ap.parse_args()

    from k3bundle import runtime

    runtime.apply()  # the command line's CPU policy (OpenMP passive wait, thread count), before torch
    import numpy
    import torch

    from k3bundle.io.files import tree_digest
    from k3bundle.synth import write_synthetic

    report = {"machine": f"{cpu_name()} ({platform.machine()}, {platform.system()})",
              "python": platform.python_version(), "numpy": numpy.__version__, "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        for preset in ("tiny", "small") if args.small else ("tiny",):
            t = time.monotonic()
            res = write_synthetic(root / preset, preset=preset, seed=0, force=True)
            report[f"{preset} seed 0"] = {"tree_digest": tree_digest(res.out),
                                          "seconds": round(time.monotonic() - t, 1)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
