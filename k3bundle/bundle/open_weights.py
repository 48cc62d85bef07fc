"""The executor's weights of a path, whichever it is: a bundle or a source checkpoint.

``golden``, ``validate`` and ``run`` accept either. A bundle (it has ``manifest.json``) gives its
device weights with every rank merged (``BundleWeights``): for a pass-through bundle these are the
source's values bit for bit (``verify`` proves it). A checkpoint (it has ``config.json``) gives its
tensors through the schema (``SourceWeights``). This module is the one place that tells them apart.
"""

from __future__ import annotations

from pathlib import Path

from k3bundle.bundle.errors import BundleError
from k3bundle.bundle.weights import BundleWeights
from k3bundle.config import load_config
from k3bundle.executor import SourceWeights, WeightSource
from k3bundle.executor.weights import resident_budget
from k3bundle.file_names import CONFIG, MANIFEST
from k3bundle.schema import Schema


def weights_kind(path: str | Path) -> str:
    """"bundle" or "checkpoint"; a ``BundleError`` naming ``path`` when it is neither."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return "bundle"
    if (path / CONFIG).is_file():
        return "checkpoint"
    raise BundleError(f"{path}: neither a bundle ({MANIFEST}) nor a checkpoint ({CONFIG})")


def streamed_weights(source: str | Path, dtype: str, device: str) -> bool:
    """True where a checkpoint's non-expert tensors in ``dtype`` exceed the resident budget of
    ``device`` (``resident_budget``): the real model's 57 B non-expert parameters are 227 GB in
    float32, more than any one GPU holds, so they stream one layer ahead instead."""
    cfg = load_config(source)
    t, totals = cfg.text, Schema(cfg).totals
    experts = len(t.moe_layers) * t.num_experts * 3 * t.moe_intermediate_size * t.routed_expert_hidden_size
    esize = 8 if dtype == "float64" else 4
    return (totals.text_params - experts) * esize > resident_budget(device, dtype)


def open_weights(path: str | Path, dtype: str = "float32", device: str = "cpu", *,
                 resident: bool | None = True) -> WeightSource:
    """The executor's weight source for ``path`` (a bundle or a checkpoint; ``weights_kind``).

    Args:
        path (`Path`): the bundle or checkpoint directory.
        dtype (`str`): the executor's dtype policy ("float32", "bfloat16", "float64").
        device (`str`): any torch device.
        resident (`bool`, optional): True keeps what was read for the next request (a bundle up to
            ``resident_budget``, a checkpoint every non-expert tensor): a teacher-forced run asks for
            every layer again at each decode step. False reads every request afresh. None decides:
            a checkpoint too large to keep (``streamed_weights``) streams one layer ahead
            (``SourceWeights(prefetch=True)``), anything else is kept.

    Returns:
        ``BundleWeights`` or ``SourceWeights``.
    """
    path = Path(path)
    if weights_kind(path) == "bundle":
        return BundleWeights(path, dtype=dtype, device=device,
                             resident_bytes=resident_budget(device, dtype) if resident is not False else 0)
    if resident is None:
        stream = streamed_weights(path, dtype, device)
        return SourceWeights(path, dtype=dtype, device=device, resident=not stream, prefetch=stream)
    return SourceWeights(path, dtype=dtype, device=device, resident=resident)


__all__ = ["open_weights", "streamed_weights", "weights_kind"]
