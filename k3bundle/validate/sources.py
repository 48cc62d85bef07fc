"""Which weights play the device under test: a bundle's device weights or a source checkpoint."""

from __future__ import annotations

from pathlib import Path

from k3bundle.executor import SourceWeights
from k3bundle.validate.run import ValidateError


def weights_factory(path: str | Path, device: str = "cpu", ranks: str = "merged", nproc: int | None = None):
    """A function dtype -> WeightSource for ``path``.

    A bundle (``manifest.json`` present) is read through its device weights, every rank merged
    in this process (``ranks="merged"``) or one torch.distributed process per rank
    (``ranks="distributed"``). A plain checkpoint directory is read as the source itself, which
    checks the executor and the goldens against each other.
    """
    path = Path(path)
    if (path / "manifest.json").is_file():
        from k3bundle.bundle.weights import BundleWeights
        from k3bundle.validate.distributed import DistributedDevice

        if ranks == "distributed":
            return DistributedDevice(path, device=device, nproc=nproc)
        return lambda dtype: BundleWeights(path, dtype=dtype, device=device)
    if (path / "config.json").is_file():
        if ranks == "distributed":
            raise ValidateError(f"{path}: --ranks distributed needs a bundle (a checkpoint has no ranks)")
        return lambda dtype: SourceWeights(path, dtype=dtype, device=device, resident=True)
    raise ValidateError(f"{path}: neither a bundle (manifest.json) nor a checkpoint (config.json)")
