"""The Prometheus text exposition format, read by hand: what ``/metrics`` of an engine reports.

vLLM, SGLang and most servers built on ``prometheus_client`` expose ``name{label="v",...} value``
lines, with ``#`` comments. A soak samples a few gauges (``vllm:gpu_cache_usage_perc``,
``process_resident_memory_bytes``, ...) over time; series of one name with different labels are
summed (one number per name per sample), which is what a leak test on a total needs.
"""

from __future__ import annotations

import math
import urllib.request


def parse(text: str) -> dict[str, float]:
    """``{name: value}``, the values of a name's labelled series added up; unreadable lines skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        if brace >= 0:
            name, rest = line[:brace], line[line.rfind("}") + 1:]
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not name or not fields:
            continue
        try:
            value = float(fields[0])  # an optional timestamp may follow
        except ValueError:
            continue
        if math.isfinite(value):
            out[name] = out.get(name, 0.0) + value
    return out


def scrape(url: str, timeout: float = 10.0) -> dict[str, float] | None:
    """The metrics at ``url``, or None where there are none (no route, not reachable)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return parse(r.read().decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None
