"""A number and the formula that gives it: every checklist number carries its derivation.

``Quantity.formula`` is written twice over: the symbols, then the same expression with this
target's numbers substituted, so a reader can redo the arithmetic by hand.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Quantity:
    key: str  # machine name, e.g. "weights_bytes_per_rank"
    label: str  # for people
    value: float | int | None  # None: unbounded / not applicable
    unit: str  # "B", "B/token", "B/request", "tokens", "requests", "FLOP", "s", "ratio", "token/s"
    formula: str

    @property
    def text(self) -> str:
        return fmt(self.value, self.unit)

    def to_dict(self) -> dict:
        return {"key": self.key, "label": self.label, "value": self.value, "unit": self.unit,
                "text": self.text, "formula": self.formula}


def gb(n: float) -> str:
    """Bytes for people: decimal units, as card vendors quote memory."""
    a = abs(n)
    if a >= 1e9:
        return f"{n / 1e9:,.2f} GB"
    if a >= 1e6:
        return f"{n / 1e6:,.2f} MB"
    return f"{int(n):,} B"


def seconds(s: float) -> str:
    if s >= 1:
        return f"{s:,.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:,.3f} ms"
    return f"{s * 1e6:,.2f} µs"


def flops(f: float) -> str:
    for scale, name in ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP")):
        if abs(f) >= scale:
            return f"{f / scale:,.2f} {name}"
    return f"{f:,.0f} FLOP"


def fmt(value: float | int | None, unit: str) -> str:
    if value is None:
        return "unbounded"
    if unit.startswith("B"):
        suffix = unit[1:]
        return gb(value) + suffix
    if unit == "s":
        return seconds(value)
    if unit == "FLOP":
        return flops(value)
    if unit == "ratio":
        return f"{value * 100:.1f}%"
    if unit == "token/s":
        return f"{value:,.0f} token/s"
    if unit in ("tokens", "requests"):
        return f"{int(value):,} {unit if int(value) != 1 else unit[:-1]}"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.3f} {unit}".strip()
    return f"{int(value):,} {unit}".strip()


def floor_div(a: int, b: int) -> int:
    """floor(a / b) for bytes that may be negative (nothing fits: 0)."""
    return max(0, a // b) if b > 0 else 0


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
