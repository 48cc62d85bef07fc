"""What a planted fault is: where it was planted (the layer and tap a located first failure
names), and for a fault of the device side of a run, what the device does wrong."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Planted:
    """The layer and tap where the fault enters the computation: validate's first failure
    must name both for the fault to count as located."""

    layer: int
    tap: str


@dataclass(frozen=True)
class DeviceSide:
    """A device whose run of a clean bundle is wrong: ``after_step(step, cache)`` handles the
    cache between decode steps (``executor.case.run_case``); ``kernels`` are ops one layer runs
    wrongly, {layer: {op name: implementation}} (``ops.contract.Backend.layers``)."""

    after_step: Callable | None = None
    kernels: dict[int, dict[str, Callable]] = field(default_factory=dict)
