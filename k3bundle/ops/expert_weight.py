"""One routed expert's projection as a weight source hands it to the grouped-expert op.

``value()`` is the logical weight [rows, cols] in the dtype policy's weight dtype, decoded by
k3bundle's own codec (what the reference computes with), made once on first use. ``mxfp4()`` is
the stored form where the source keeps the expert as one MXFP4 slice: the packed E2M1 codes
[rows, cols/2] uint8 (low nibble = even column) and the E8M0 scales [rows, cols/32] uint8,
row-major (un-swizzled), without layout padding, on the source's device. A backend that decodes
MXFP4 itself reads ``mxfp4()``; where it is None (NVFP4, FP8 or BF16 storage, or an expert split
over TP ranks) it uses ``value()``. Both are read lazily: an op pays only for the form it uses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Packed = tuple[torch.Tensor, torch.Tensor]


#: how a source decodes many experts of one role at once: (a key naming the source, layer and role,
#: a function of expert ids -> their values, this expert's id)
Batch = tuple[object, Callable[[list[int]], list[torch.Tensor]], int]


class ExpertWeight:
    __slots__ = ("_make", "_value", "_mxfp4", "shape", "batch")

    def __init__(self, value: Callable[[], torch.Tensor] | torch.Tensor,
                 mxfp4: Callable[[], Packed | None] | Packed | None = None,
                 shape: tuple[int, ...] | None = None, batch: Batch | None = None):
        self._make, self._value = (None, value) if isinstance(value, torch.Tensor) else (value, None)
        self._mxfp4 = mxfp4
        self.shape = tuple(value.shape) if isinstance(value, torch.Tensor) else shape  # None: unknown until made
        self.batch = batch

    def value(self) -> torch.Tensor:
        if self._value is None:
            self._value = self._make()
            self._make = None
        return self._value

    @property
    def decoded(self) -> bool:
        """True once ``value()`` has been made (a cached expert: decoding again would be waste)."""
        return self._value is not None

    def mxfp4(self) -> Packed | None:
        if callable(self._mxfp4):
            self._mxfp4 = self._mxfp4()
        return self._mxfp4


def values(ws: list) -> list[torch.Tensor]:
    """``w.value()`` of each of ``ws`` (ExpertWeights or tensors); those not yet made that share a
    ``batch`` key are made by one call of its function (a bundle decodes a rank's stacked experts
    in one pass, not one by one: the same values)."""
    todo: dict[object, list[ExpertWeight]] = {}
    for w in ws:
        if isinstance(w, ExpertWeight) and w._value is None and w.batch is not None:
            todo.setdefault(w.batch[0], []).append(w)
    for group in todo.values():
        if len(group) > 1:
            for w, v in zip(group, group[0].batch[1]([w.batch[2] for w in group])):
                w._value, w._make = v, None
    return [w.value() if isinstance(w, ExpertWeight) else w for w in ws]


def logical(expert: dict | None) -> dict | None:
    """{role: ExpertWeight} -> {role: logical tensor} (None stays None)."""
    return None if expert is None else {r: w.value() if isinstance(w, ExpertWeight) else w for r, w in expert.items()}
