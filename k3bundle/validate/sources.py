"""Which device ``k3bundle validate`` judges, from its options (``open_device``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from k3bundle.bundle.weights import BundleWeights
from k3bundle.config import load_config
from k3bundle.executor import SourceWeights
from k3bundle.validate.devices import Device, Dumps, InProcess
from k3bundle.validate.distributed import Distributed
from k3bundle.validate.errors import ValidateError


def weights_for(path: Path, device: str = "cpu") -> Callable[[str], object]:
    """dtype policy -> the executor's weights for ``path``: a bundle's device weights, every
    rank merged, or a source checkpoint (which checks the executor and the goldens against
    each other)."""
    if (path / "manifest.json").is_file():
        return lambda dtype: BundleWeights(path, dtype=dtype, device=device)
    if (path / "config.json").is_file():
        return lambda dtype: SourceWeights(path, dtype=dtype, device=device, resident=True)
    raise ValidateError(f"{path}: neither a bundle (manifest.json) nor a checkpoint (config.json)")


def open_device(path: str | Path, device: str = "cpu", ranks: str = "merged", nproc: int | None = None,
                dumps: str | Path | None = None, rank_results: str | Path | None = None) -> Device:
    """The device under test: ``dumps`` (an external runtime), one process per rank
    (``ranks="distributed"``), or the built-in executor in this process."""
    path = Path(path)
    if ranks not in ("merged", "distributed"):
        raise ValidateError(f"--ranks must be merged or distributed, got {ranks!r}")
    if dumps is not None and not Path(dumps).is_dir():
        raise ValidateError(f"{dumps}: --dumps must be a folder of CASE.safetensors files, and this is "
                            f"{'not a folder' if Path(dumps).exists() else 'missing'}")
    factory = weights_for(path, device)
    if dumps is not None:
        dumps = Path(dumps)
        text = load_config(path).text
        return Dumps(dumps, factory, device, vocab=text.vocab_size, experts=text.num_experts)
    if ranks == "distributed":
        if not (path / "manifest.json").is_file():
            raise ValidateError(f"{path}: --ranks distributed needs a bundle (a checkpoint has no ranks)")
        return Distributed(path, device=device, nproc=nproc, results=rank_results)
    if rank_results is not None:
        raise ValidateError("--rank-results needs --ranks distributed")
    return InProcess(factory, device, source=path)
