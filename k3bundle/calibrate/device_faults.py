"""Faults of the device side of a run: the bundle is clean, the serving engine is not.

Each takes the model's ``TextConfig`` and returns what the device does wrong (``DeviceSide``)
and where that enters the computation (``Planted``): cache handling between decode steps,
through the device's ``after_step`` hook (a KDA state restored one step late, an MLA cache row
lost).
"""

from __future__ import annotations

import torch

from k3bundle.calibrate.planted import DeviceSide, Planted
from k3bundle.config import TextConfig

SERVING_STEP = 4  # a cache fault is planted after this decode step (0-based); the greedy case decodes 16


def _kda_layer(text: TextConfig, at_least: int) -> int:
    return next(l for l in text.kda_layers if l >= at_least)


# ---------------------------------------------------------------- cache handling between steps
def kda_state_late(text: TextConfig):
    """A KDA layer's state (recurrent and conv) restored one step late: after decode step
    SERVING_STEP the engine puts back the state it had saved one step earlier."""
    layer = _kda_layer(text, 4)
    saved = {}

    def after_step(step, cache):
        s = cache.layers[layer]
        if step == SERVING_STEP - 1:
            saved["s"] = s.clone()
        elif step == SERVING_STEP:
            s.recurrent_HKV.copy_(saved["s"].recurrent_HKV)
            s.conv_3WP.copy_(saved["s"].conv_3WP)
    return DeviceSide(after_step=after_step), Planted(layer, f"decode.layers.{layer}.mixer_out")


def mla_row_dropped(text: TextConfig):
    """One row of an MLA layer's latent cache lost (a page slot skipped): after decode step
    SERVING_STEP the row of the middle prompt token is gone and later steps attend without it."""
    layer = text.mla_layers[0]

    def after_step(step, cache):
        if step == SERVING_STEP:
            s = cache.layers[layer]
            j = s.length // 2
            kept = torch.cat([s.latent_SC[:j], s.latent_SC[j + 1:]]).clone()
            s.buffer_SC[: s.length - 1] = kept
            s.length -= 1
    return DeviceSide(after_step=after_step), Planted(layer, f"decode.layers.{layer}.mixer_out")
