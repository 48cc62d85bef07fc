"""Device storage of one weight slice under a layout: the registry's format for its rule.

A layout's ``formats`` gives each role a ``FormatRule`` (``k3bundle.layouts``); the storage
registry (``k3bundle.storage``) says what that format stores. Given the rule, the scale layout
and the shape of one rank's (padded) slice of a weight, ``device_parts`` lists the device
tensors that store it: part name, name suffix (``None`` keeps the source tensor's own name),
dtype, shape, which source part it is read from, the transform, and the row granularity the
encoder works in.

Shapes are per weight (per expert for routed experts); stacking adds a leading expert dim.
"""

from __future__ import annotations

from k3bundle.layouts import FormatRule
from k3bundle.schema import Role
from k3bundle.storage import EXACT_TRANSFORMS, DevicePart, StorageFormat, storage_for

__all__ = ["DevicePart", "EXACT_TRANSFORMS", "device_parts", "storage_format", "storage_name"]


def storage_format(rule: FormatRule, role: Role) -> StorageFormat:
    """The concrete storage format of a role under its layout rule."""
    return storage_for(rule.format, role, rule.convention)


def storage_name(rule: FormatRule, role: Role) -> str:
    """The concrete storage of a role: ``source``/``bf16``/``f32`` collapse to the source format."""
    return storage_for(rule.format, role).name


def device_parts(role: Role, rule: FormatRule, swizzled: bool, shape: tuple[int, ...],
                 source_dtype: str) -> list[DevicePart]:
    """The device tensors storing one (padded) slice of ``role`` of logical ``shape``.

    Args:
        role: the tensor role.
        rule: its format rule from the layout.
        swizzled: the layout's scale layout is ``swizzled-128x4`` (block scales only).
        shape: logical shape of the slice, padding included (dequantized shape for MXFP4).
        source_dtype: the stored dtype of the (non-MXFP4) source tensor.
    """
    return storage_format(rule, role).parts(shape, swizzled, source_dtype, rule.scale_rule)
