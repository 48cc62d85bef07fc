"""The fault catalogue: every planted fault a calibration runs, by name.

A fault is of the bundle (``weight_faults``: a copy of the clean bundle with one defect in its
bytes) or of the device (``device_faults``: the clean bundle on a device whose cache handling or
one layer's kernel is wrong). Each states where it enters the computation (``Planted``); a
faulted run counts as *located* when validate's first failure names that layer and tap.
docs/validation.md "The fault catalogue" lists them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from k3bundle.calibrate import device_faults, weight_faults
from k3bundle.errors import K3Error


#: a case whose prompt spans several KDA chunks (260 tokens of the tiny tokenizer: four chunk
#: boundaries) with every position tapped: the greedy case's prompt fits in one chunk
CHUNKED_CASE = "thinking"


@dataclass(frozen=True)
class Fault:
    name: str
    kind: str  # "bundle" (plant(bundle, golden, rng) edits a copy) or "device" (plant(text) -> DeviceSide, Planted)
    plant: Callable
    case: str = "greedy"  # the golden case the faulted run judges

    @property
    def doc(self) -> str:
        return " ".join((self.plant.__doc__ or "").split())


def _catalogue() -> dict[str, Fault]:
    w, d = weight_faults, device_faults
    faults = [
        Fault("dt_bias", "bundle", w.dt_bias),
        Fault("swap_experts", "bundle", w.swap_experts),
        Fault("scale_byte", "bundle", w.scale_byte),
        Fault("transposed_shard", "bundle", w.transposed_shard),
        Fault("router_bias", "bundle", w.router_bias),
        Fault("weight_1e-3", "bundle", w.perturb_layer(1e-3)),
        Fault("weight_1e-2", "bundle", w.perturb_layer(1e-2)),
        Fault("weight_1e-1", "bundle", w.perturb_layer(1e-1)),
        Fault("nan_weight", "bundle", w.nan_weight),
        Fault("router_bias_sign", "bundle", w.router_bias_sign),
        Fault("kda_state_late", "device", d.kda_state_late),
        Fault("mla_row_dropped", "device", d.mla_row_dropped),
        Fault("silu_experts", "device", d.silu_experts),
        Fault("kda_chunk_carry", "device", d.kda_chunk_carry, case=CHUNKED_CASE),
        Fault("conv_state_stuck", "device", d.conv_state_stuck),
        Fault("l2norm_missing_decode", "device", d.l2norm_missing_decode),
    ]
    return {f.name: f for f in faults}


FAULTS: dict[str, Fault] = _catalogue()


def fault(name: str) -> Fault:
    """The catalogue's fault ``name``; an unknown name is one line listing the known ones."""
    if name not in FAULTS:
        raise K3Error(f"no fault {name!r} in the catalogue; known: {', '.join(FAULTS)}")
    return FAULTS[name]
