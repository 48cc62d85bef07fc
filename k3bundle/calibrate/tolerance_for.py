"""Which shipped tolerance file judges a shipped layout by default (its storage format's)."""

from __future__ import annotations

TOLERANCE_FOR = {"b300-tp8": "bf16", "gb300-dep16": "bf16", "h200-tp16-ep16": "bf16", "mi355x-tp8": "fp8",
                 "b200-tp8-pp2": "bf16"}


def tolerance_for(layout: str) -> str:
    return TOLERANCE_FOR.get(layout, "bf16")
