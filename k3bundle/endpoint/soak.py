"""``k3bundle soak``: golden requests replayed against an endpoint for minutes or hours.

Each pass sends every golden request in turn (``replay.send``: streamed, greedy, under a
watchdog). What is measured, and what is a named failure:

- determinism: a request's output (token ids, else text) must equal its first answer every time
  (temperature 0); a difference is a ``determinism`` failure naming the request and the first
  differing position;
- hangs: a request past ``--timeout`` is a ``hang`` failure naming the request;
- errors: any other failed request is an ``error`` failure with the endpoint's message;
- latency drift: median TTFT and TPOT of the first and the last window (each a tenth of the run,
  at least one pass), measured, not judged;
- memory: the server's host memory (RssAnon + VmSwap of ``--server-pid`` from /proc, else the
  ``process_resident_memory_bytes`` its /metrics reports) and the engine's gauges (vLLM's
  ``vllm:gpu_cache_usage_perc``, ...), sampled between requests; after the first window, the
  least-squares slope per hour, and for host memory its fitted growth over the run held to the
  sign-off limit: above it, a ``leak`` failure.

``run`` stops at the duration or on Ctrl-C; an interrupted run is reported incomplete, never as a
pass. Pure of I/O beyond the endpoint and the samplers it is given.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from k3bundle.endpoint.client import Endpoint
from k3bundle.endpoint.replay import GoldenRequest, Sent, first_difference, send

#: gauges sampled from /metrics where the engine reports them
GAUGES = ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
          "vllm:num_requests_waiting", "sglang:token_usage", "sglang:num_running_reqs",
          "process_resident_memory_bytes")
HOST_FROM_METRICS = "process_resident_memory_bytes"
WINDOW = 0.1  # the first and last windows, as a share of the run


@dataclass
class Failure:
    kind: str  # determinism, hang, error, leak
    request: str
    at_s: float
    detail: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class SoakRun:
    duration_s: float
    sent: list[Sent] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    memory: list[tuple[float, int]] = field(default_factory=list)  # (s, bytes)
    memory_source: str | None = None
    gauges: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    elapsed_s: float = 0.0
    complete: bool = False
    passes: int = 0
    first: dict[str, Sent] = field(default_factory=dict)  # each request's first answer (the reference)


def slope_per_hour(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per hour; None under two distinct times."""
    if len(points) < 2:
        return None
    mt = sum(t for t, _ in points) / len(points)
    mv = sum(v for _, v in points) / len(points)
    sxx = sum((t - mt) ** 2 for t, _ in points)
    if sxx == 0:
        return None
    return sum((t - mt) * (v - mv) for t, v in points) / sxx * 3600.0


def after_warmup(points: Sequence[tuple[float, float]], elapsed_s: float) -> list[tuple[float, float]]:
    """The points after the first window (all of them where that leaves fewer than two)."""
    late = [p for p in points if p[0] >= WINDOW * elapsed_s]
    return late if len(late) >= 2 else list(points)


def windows(sent: Sequence[Sent], elapsed_s: float, per_pass: int) -> tuple[list[Sent], list[Sent]]:
    """The requests of the first and last windows: a tenth of the run each, at least one pass."""
    ok = [s for s in sent if s.ok]
    span = WINDOW * elapsed_s
    first = [s for s in ok if s.started_s <= span] or ok[:per_pass]
    last = [s for s in ok if s.started_s >= elapsed_s - span] or ok[-per_pass:]
    if len(first) < per_pass:
        first = ok[:per_pass]
    if len(last) < per_pass:
        last = ok[-per_pass:]
    return first, last


def latency(group: Sequence[Sent]) -> dict:
    ttft = [s.ttft_s for s in group if s.ttft_s is not None]
    tpot = [s.tpot_s for s in group if s.tpot_s is not None]
    return {"requests": len(group), "ttft_s": statistics.median(ttft) if ttft else None,
            "tpot_s": statistics.median(tpot) if tpot else None}


def host_growth(run: SoakRun) -> int | None:
    """Fitted host memory growth over the run after warm-up (slope x span), in bytes."""
    pts = after_warmup(run.memory, run.elapsed_s)
    s = slope_per_hour(pts)
    return None if s is None else int(round(s * (pts[-1][0] - pts[0][0]) / 3600.0))


class _Sampler:
    def __init__(self, host_memory: Callable[[], int | None] | None, metrics: Callable[[], dict | None] | None):
        self.host_memory, self.metrics = host_memory, metrics

    def sample(self, run: SoakRun, t: float) -> None:
        m = self.metrics() if self.metrics else None
        for name in GAUGES:
            if m and name in m:
                run.gauges.setdefault(name, []).append((t, m[name]))
        host = self.host_memory() if self.host_memory else None
        if host is not None:
            run.memory.append((t, host))
            run.memory_source = run.memory_source or "pid"
        elif m and HOST_FROM_METRICS in m and run.memory_source != "pid":
            run.memory.append((t, int(m[HOST_FROM_METRICS])))
            run.memory_source = f"/metrics {HOST_FROM_METRICS}"


def _judge(run: SoakRun, first: dict[str, Sent], s: Sent) -> None:
    if s.hang:
        run.failures.append(Failure("hang", s.request, s.started_s, s.error or "watchdog"))
        return
    if s.error is not None:
        run.failures.append(Failure("error", s.request, s.started_s, s.error))
        return
    ref = first.setdefault(s.request, s)
    if ref is s or ref.output == s.output:
        return
    i = first_difference(ref.output, s.output)
    unit = "token" if s.token_ids is not None and ref.token_ids is not None else "character"
    was = ref.output[i] if i < len(ref.output) else "(end)"
    now = s.output[i] if i < len(s.output) else "(end)"
    run.failures.append(Failure("determinism", s.request, s.started_s,
                                f"differs from its first answer at {unit} {i}: first {was!r}, now {now!r} "
                                f"({len(ref.output)} against {len(s.output)} {unit}s)"))


def run(ep: Endpoint, requests: Sequence[GoldenRequest], duration_s: float, *, max_tokens: int, timeout_s: float,
        host_memory: Callable[[], int | None] | None = None, metrics: Callable[[], dict | None] | None = None,
        host_limit_bytes: int | None = None, say: Callable[[str], None] = lambda s: None,
        every_s: float = 10.0) -> SoakRun:
    """Replay ``requests`` for ``duration_s``; Ctrl-C ends it early with ``complete`` False."""
    out = SoakRun(duration_s)
    first = out.first
    sampler = _Sampler(host_memory, metrics)
    t0 = time.perf_counter()
    last_say = t0
    try:
        sampler.sample(out, 0.0)
        while time.perf_counter() - t0 < duration_s:
            for req in requests:
                s = send(ep, req, max_tokens, timeout_s, t0)
                out.sent.append(s)
                _judge(out, first, s)
                if first.get(s.request) is not s:  # judged: only the references keep their output,
                    s.token_ids, s.text = None, ""  # so an hours-long run holds timings, not completions
                sampler.sample(out, time.perf_counter() - t0)
                now = time.perf_counter()
                if now - last_say >= every_s:
                    last_say = now
                    say(progress(out, now - t0))
            out.passes += 1
        out.complete = True
    except KeyboardInterrupt:
        say("soak: interrupted; writing what was measured, marked incomplete")
    out.elapsed_s = time.perf_counter() - t0
    growth = host_growth(out)
    if host_limit_bytes is not None and growth is not None and growth > host_limit_bytes:
        out.failures.append(Failure("leak", "(server)", out.elapsed_s,
                                    f"host memory grew {growth:,} B after warm-up ({out.memory_source}), "
                                    f"above the {host_limit_bytes:,} B limit"))
    return out


def progress(r: SoakRun, t: float) -> str:
    kinds = {k: sum(f.kind == k for f in r.failures) for k in ("determinism", "hang", "error")}
    mem = f", host memory {r.memory[-1][1] / (1 << 20):,.1f} MiB" if r.memory else ""
    return (f"soak: {t / 60:.1f} of {r.duration_s / 60:.1f} min, {len(r.sent)} requests, "
            f"{kinds['error']} errors, {kinds['hang']} hangs, {kinds['determinism']} determinism failures{mem}")
