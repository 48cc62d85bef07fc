"""The batching path of ``validate --serving`` (docs/validation.md "Serving paths"): the case's
prompt and other requests of different lengths run as one batch (``executor.batching``), each
judged against itself run alone on the single-request path.

The other requests are deterministic: prefixes of the other golden cases' prompts judged in the
same run (in the goldens' order; the case's own prompt where there are fewer), of about 2/3 and
1/3 of the case's prompt length, each decoding the tokens that follow it in its source prompt
with that case's golden expert choices replayed. The case itself decodes its golden tokens.

Checks, in the order a fault propagates (the first failure locates it, to the request, layer and
tap; ``request.{r}.…``, r = 0 the case):

1. ``request.{r}.layers.{l}.{attn_res_out|mixer_out|ffn_res_out|ffn_out}``: every layer's outputs
   over the prompt, by the ``inherited`` limits of their kind;
2. ``request.{r}.logits``: the prompt's logits, by the logits limits;
3. ``request.{r}.prefill.layers.{l}.{kda_state|kda_conv|mla_latent}``: the cache after the prompt,
   by the ``inherited`` limits of its state kind (padding that entered a state shows here first);
4. ``request.{r}.decode.layers.{l}.…`` and ``request.{r}.step_logits``: the decode steps at
   batch N against batch 1;
5. ``request.{r}.final.layers.{l}.…``: the cache after the last step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3bundle.executor.batching import ROW_TAPS, Leak, Request, RequestRun, alone, batched
from k3bundle.executor.cache import cache_arrays
from k3bundle.executor.case import golden_routes
from k3bundle.golden.tolerances import Tolerances
from k3bundle.validate.compare import TapResult, compare_logits, compare_tensor

BATCH_MAX_TOKENS = 4096  # the batch holds B copies of the longest prompt's activations and taps
SHARES = (2 / 3, 1 / 3)  # the other requests' lengths, as shares of the case's prompt


@dataclass
class BatchPair:
    """The batch as the device ran it, beside each request run alone."""

    labels: list[str] = field(default_factory=list)  # where each request comes from
    requests: list[Request] = field(default_factory=list)
    refs: list[RequestRun] = field(default_factory=list)
    cands: list[RequestRun] = field(default_factory=list)
    reason: str = ""  # why it did not run


def batch_requests(ids: list[int], golden: dict, others: list[tuple[str, list[int], dict]],
                   case: str = "case") -> tuple[list[str], list[Request]]:
    """The case's request first, then one per ``SHARES``: a prefix of the next other case (name,
    ids, golden arrays) or of the case's own prompt."""
    tokens = [int(t) for t in golden["greedy_tokens"]]
    labels, reqs = [f"{case} ({len(ids)} tokens)"], [Request(list(ids), tokens, golden_routes(golden))]
    sources = list(others) + [(case, list(ids), golden)] * len(SHARES)
    for share, (name, src, g) in zip(SHARES, sources):
        n = max(1, min(round(len(ids) * share), len(src) - 1))
        follow = [int(t) for t in src[n:n + max(1, len(tokens))]] or [int(src[-1])]
        labels.append(f"{name}[:{n}]")
        reqs.append(Request([int(i) for i in src[:n]], follow, golden_routes(g)))
    return labels, reqs


def run_batch(weights, golden: dict, ids: list[int], others=(), leak: Leak | None = None,
              case: str = "case") -> BatchPair:
    """Each request alone, then all of them as one batch (``leak``: a planted fault)."""
    if len(ids) > BATCH_MAX_TOKENS:
        return BatchPair(reason=f"the prompt ({len(ids):,} tokens) is longer than the batched path runs "
                                f"({BATCH_MAX_TOKENS:,} tokens)")
    if getattr(weights, "backend", None) is not None:
        return BatchPair(reason="the batched path runs the reference kernels, not the backend's (--backend)")
    labels, reqs = batch_requests(ids, golden, list(others), case)
    refs = [alone(weights, r) for r in reqs]
    return BatchPair(labels, reqs, refs, batched(weights, reqs, leak=leak))


def _tensor(case, name, a, b, tol) -> TapResult:
    if a.shape != b.shape:
        return TapResult(case, name, "exact", {"rows": float(b.shape[0])}, {}, False, {"rows": float(a.shape[0])})
    return compare_tensor(case, name, a.double().cpu(), b.double().cpu(), tol, "inherited")


def batch_checks(case: str, pair: BatchPair, tol: Tolerances) -> list[TapResult]:
    """Every check of the batch, in propagation order (stage, layer, request)."""
    reqs = list(enumerate(zip(pair.refs, pair.cands)))
    layers = len(pair.refs[0].final.layers)
    out = []

    def rows(prefix: str):
        for l in range(layers):
            for kind in ROW_TAPS:
                for r, (a, b) in reqs:
                    n = f"{prefix}layers.{l}.{kind}"
                    if a.taps[n].numel() or b.taps[n].numel():
                        out.append(_tensor(case, f"request.{r}.{n}", a.taps[n], b.taps[n], tol))

    def states(stage: str, cache):
        for i in range(len(cache_arrays(pair.refs[0].final))):
            for r, (a, b) in reqs:
                (n, x), (_, y) = cache_arrays(cache(a))[i], cache_arrays(cache(b))[i]
                out.append(_tensor(case, f"request.{r}.{stage}.{n}", x, y, tol))

    rows("")
    out += [compare_logits(case, f"request.{r}.logits", a.logits.double(), b.logits.double(), tol) for r, (a, b) in reqs]
    states("prefill", lambda run: run.prefilled)
    rows("decode.")
    out += [compare_logits(case, f"request.{r}.step_logits", a.step_logits.double(), b.step_logits.double(), tol)
            for r, (a, b) in reqs]
    states("final", lambda run: run.final)
    return out


def describe(pair: BatchPair) -> str:
    """``3 requests: multi_turn (112 tokens), greedy[:75], thinking[:37]; decode 16, 16, 16 steps``."""
    steps = ", ".join(str(len(r.tokens)) for r in pair.requests)
    return f"{len(pair.requests)} requests: {', '.join(pair.labels)}; decode {steps} steps"
