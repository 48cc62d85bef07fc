"""``k3bundle perf``: a workload swept over concurrency levels against any OpenAI-compatible endpoint.

At each level ``c``, ``c`` clients (threads sharing one ``Endpoint``) each run the workload's
sessions one after another, every turn a streamed, greedy ``/v1/completions`` request of exactly
``output_tokens`` tokens (``ignore_eos``). Per request: TTFT (send to the first output chunk) and
TPOT (first to last output chunk over the tokens after the first). Per level: P50 and P99 of both,
request and output-token throughput over the level's wall time (first send to last answer).

Speculative decoding, where the endpoint reports it (vLLM's ``spec_decode`` counters at
``/metrics``, read before and after each level) or where ``--draft-tokens K`` says how many
tokens each step drafts (steps then counted as streamed chunks, one per engine step): TPOT per
step, per drafted token and the acceptance (``spec_normalise``). Otherwise the level says "not
reported by the endpoint".

Pure functions (``percentile``, ``request_tpot``, ``level_stats``, ``spec_normalise``) do the
arithmetic; ``run_level`` and ``sweep`` are the I/O.
"""

from __future__ import annotations

import math
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from k3bundle.endpoint.client import Endpoint
from k3bundle.endpoint.errors import EndpointError
from k3bundle.endpoint.workloads import Workload, as_text

NOT_REPORTED = "not reported by the endpoint"
#: vLLM's speculative-decoding counters (Prometheus text at /metrics)
SPEC_METRICS = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
                "accepted": "vllm:spec_decode_num_accepted_tokens"}


# ---- pure arithmetic ----------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between closest ranks (numpy's
    default): position (n − 1) × q / 100 in the sorted values."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def request_tpot(intervals_s: Sequence[float], tokens: int) -> float | None:
    """Time per output token of one request: first to last output chunk over the tokens after the
    first; None for a request of fewer than 2 tokens."""
    if tokens < 2 or not intervals_s:
        return None
    return sum(intervals_s) / (tokens - 1)


@dataclass
class RequestRecord:
    client: int
    session: int
    turn: int
    prompt_tokens: int
    output_tokens: int
    chunks: int  # output chunks streamed (one per engine step where the engine streams each step)
    start_s: float  # since the level started
    ttft_s: float
    total_s: float
    tpot_s: float | None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def level_stats(records: Sequence[RequestRecord], wall_s: float) -> dict:
    """P50/P99 TTFT and TPOT, request and output-token throughput of one level's requests."""
    ttft = [r.ttft_s for r in records]
    tpot = [r.tpot_s for r in records if r.tpot_s is not None]
    tokens = sum(r.output_tokens for r in records)
    return {"requests": len(records), "wall_s": wall_s, "output_tokens": tokens,
            "prompt_tokens_median": percentile([r.prompt_tokens for r in records], 50),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_s": percentile(tpot, 50) if tpot else None, "tpot_p99_s": percentile(tpot, 99) if tpot else None,
            "request_throughput_per_s": len(records) / wall_s, "output_throughput_tokens_per_s": tokens / wall_s}


def spec_normalise(tpot_s: float, drafts: float, draft_tokens: float, accepted: float) -> dict:
    """TPOT normalised for speculative decoding, from counts over the same requests.

    ``drafts`` verification steps (per request), ``draft_tokens`` drafted, ``accepted`` of them
    accepted. Each step emits its accepted drafts and one token of its own, so
        tokens per step     τ = 1 + accepted / drafts
        time per step       = TPOT × τ                     (the roofline's unit: one forward step)
        time per drafted    = time per step / (1 + draft_tokens / drafts)   (tokens a step verifies)
        acceptance rate     = accepted / draft_tokens
    """
    if drafts <= 0 or draft_tokens <= 0:
        raise ValueError("speculative counts need at least one step and one drafted token")
    tau = 1.0 + accepted / drafts
    step = tpot_s * tau
    return {"tokens_per_step": tau, "drafted_per_step": draft_tokens / drafts, "acceptance_rate": accepted / draft_tokens,
            "accepted_per_step": accepted / drafts, "tpot_per_step_s": step,
            "tpot_per_drafted_token_s": step / (1.0 + draft_tokens / drafts), "tpot_per_accepted_token_s": tpot_s}


def parse_metrics(text: str) -> dict[str, float]:
    """Sum of every sample of each ``SPEC_METRICS`` counter in Prometheus text (``_total`` or not,
    any labels)."""
    out: dict[str, float] = {}
    for key, name in SPEC_METRICS.items():
        pat = re.compile(rf"^{re.escape(name)}(?:_total)?(?:\{{[^}}]*\}})?\s+(\S+)", re.M)
        vals = [float(m.group(1)) for m in pat.finditer(text)]
        if vals:
            out[key] = sum(vals)
    return out


# ---- I/O ----------------------------------------------------------------------------------------


def read_spec_counters(base_url: str) -> dict[str, float] | None:
    """The spec-decode counters at ``BASE/metrics`` (the URL without ``/v1``), or None where there
    are none."""
    root = base_url[:-3] if base_url.endswith("/v1") else base_url
    try:
        with urllib.request.urlopen(root + "/metrics", timeout=5) as r:
            got = parse_metrics(r.read(4 << 20).decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None
    return got if len(got) == len(SPEC_METRICS) else None


@dataclass
class Level:
    concurrency: int
    stats: dict
    records: list[RequestRecord]
    spec: dict | str = NOT_REPORTED  # spec_normalise(...) + its source, or why there is none
    bounds: dict = field(default_factory=dict)  # roofline lower bounds and measured/bound ratios

    def to_dict(self) -> dict:
        return {"concurrency": self.concurrency, **self.stats, "spec_decode": self.spec, "roofline": self.bounds,
                "requests_detail": [r.to_dict() for r in self.records]}


def _client(ep: Endpoint, w: Workload, client: int, t0: float, out: list, errors: list) -> None:
    try:
        for k in range(w.sessions_per_client):
            session = client * w.sessions_per_client + k
            for turn, ids in enumerate(w.session(session)):
                prompt = ids if w.prompt == "token_ids" else as_text(ids)
                start = time.perf_counter()
                r = ep.complete(prompt, max_tokens=w.output_tokens, stream=True,
                                extra_body={"ignore_eos": True})
                t = r.timing
                if t.ttft_s is None:
                    raise EndpointError(f"{ep.base_url}: request {session}.{turn} streamed no output")
                n = t.completion_tokens or 0
                out.append(RequestRecord(client, session, turn, t.prompt_tokens or len(ids), n,
                                         len(t.intervals_s) + 1, start - t0, t.ttft_s, t.total_s,
                                         request_tpot(t.intervals_s, n)))
    except Exception as e:  # noqa: BLE001 — handed to the caller's thread, raised there
        errors.append(e)


def run_level(ep: Endpoint, w: Workload, concurrency: int, draft_tokens: int | None = None) -> Level:
    """One concurrency level: ``concurrency`` clients at once, each running its sessions in turn."""
    before = read_spec_counters(ep.base_url)
    records: list[RequestRecord] = []
    errors: list[Exception] = []
    t0 = time.perf_counter()
    threads = [threading.Thread(target=_client, args=(ep, w, c, t0, records, errors), daemon=True)
               for c in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    records.sort(key=lambda r: r.start_s)
    stats = level_stats(records, wall)
    after = read_spec_counters(ep.base_url)
    return Level(concurrency, stats, records, spec_figures(stats, records, before, after, draft_tokens))


def spec_figures(stats: dict, records: list[RequestRecord], before, after, draft_tokens: int | None) -> dict | str:
    """The level's speculative-decoding figures: from the /metrics counters' growth over the level
    (``before``, ``after``), else from the streamed chunks with ``draft_tokens``, else ``NOT_REPORTED``."""
    tpot = stats["tpot_p50_s"]
    if tpot is None:
        return NOT_REPORTED
    if before is not None and after is not None and after["drafts"] > before["drafts"]:
        d = {k: after[k] - before[k] for k in SPEC_METRICS}
        return {"source": "/metrics (vLLM spec_decode counters)", **d,
                **spec_normalise(tpot, d["drafts"], d["draft_tokens"], d["accepted"])}
    if draft_tokens:
        steps = sum(r.chunks - 1 for r in records if r.output_tokens > 1)  # steps after the first token
        emitted = sum(r.output_tokens - 1 for r in records if r.output_tokens > 1)
        if steps > 0:
            return {"source": f"streamed chunks (one per step) with --draft-tokens {draft_tokens}", "drafts": steps,
                    "draft_tokens": steps * draft_tokens, "accepted": emitted - steps,
                    **spec_normalise(tpot, steps, steps * draft_tokens, emitted - steps)}
    return NOT_REPORTED


def attach_bounds(level: Level, bounds: Callable[[int, int], tuple[float, float]] | None) -> None:
    """The roofline's lower bounds at the level's median prompt, and each measured figure over its
    bound: TPOT at batch = concurrency (a decode step carries every request in flight); TTFT at
    batch 1 (a request's first token needs only its own prompt prefilled, whatever else runs: a
    bound at batch c would call a staggered arrival faster than possible)."""
    if bounds is None:
        return
    ctx = max(1, round(level.stats["prompt_tokens_median"]))
    tpot_b = bounds(level.concurrency, ctx)[0]
    ttft_b = bounds(1, ctx)[1]
    s = level.stats
    b = {"batch": level.concurrency, "ttft_batch": 1, "context": ctx, "tpot_bound_s": tpot_b, "ttft_bound_s": ttft_b,
         "ttft_p50_ratio": s["ttft_p50_s"] / ttft_b, "ttft_p99_ratio": s["ttft_p99_s"] / ttft_b,
         "output_throughput_bound_tokens_per_s": level.concurrency / tpot_b}
    if s["tpot_p50_s"] is not None:
        b |= {"tpot_p50_ratio": s["tpot_p50_s"] / tpot_b, "tpot_p99_ratio": s["tpot_p99_s"] / tpot_b,
              "output_throughput_ratio": s["output_throughput_tokens_per_s"] / (level.concurrency / tpot_b)}
    if isinstance(level.spec, dict):  # a step verifies 1 + k tokens per request: the bound of that batch
        k = level.spec["drafted_per_step"]
        step_b = bounds(max(1, round(level.concurrency * (1 + k))), ctx)[0]
        b |= {"step_bound_s": step_b, "step_ratio": level.spec["tpot_per_step_s"] / step_b}
    level.bounds = b


def sweep(ep: Endpoint, w: Workload, levels: Sequence[int], bounds=None, draft_tokens: int | None = None,
          say: Callable[[str], None] | None = None) -> list[Level]:
    out = []
    for c in levels:
        if say:
            say(f"perf: concurrency {c}: {c * w.sessions_per_client * w.turns} requests")
        lv = run_level(ep, w, c, draft_tokens)
        attach_bounds(lv, bounds)
        out.append(lv)
        if say:
            s = lv.stats
            say(f"perf: concurrency {c}: TTFT P50 {s['ttft_p50_s']:.3f} s, TPOT P50 "
                f"{(s['tpot_p50_s'] or 0) * 1e3:.1f} ms, {s['output_throughput_tokens_per_s']:.1f} tok/s")
    return out


__all__ = ["Level", "NOT_REPORTED", "RequestRecord", "attach_bounds", "level_stats", "parse_metrics", "percentile",
           "request_tpot", "run_level", "spec_figures", "spec_normalise", "sweep"]
