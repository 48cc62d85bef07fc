"""Two budgets beside capacity, each a list of ``Quantity`` with its formula (docs/bring-up.md):

* **prefix cache**: a KDA state is valid only at the position it was taken (docs/kimi-k3.md §5.3),
  so resuming a cached prefix needs a snapshot of every KDA layer's state there, while the MLA
  latent is pageable per token. Bytes per snapshot (per request, every KDA layer of the stage, per
  rank), snapshots per request under a policy (every N tokens, or one per turn boundary), what fits
  beside the batch's cache, and one page size for both kinds: the least common multiple of the KDA
  state page and an MLA page of P tokens (JENGA's large page), against padding the smaller kind up
  to one page size (vLLM's hybrid allocator pads the state page to the attention page);
* **prefill/decode handoff**: the bytes a request's cache takes from a prefill to a decode
  instance at ``context`` tokens (the latent plus every KDA state) and the time over one link per
  rank, next to a pure-MLA model of the same depth (every layer MLA, no state).
"""

from __future__ import annotations

import math

from k3bundle.checklist.quantity import Quantity, ceil_div, floor_div
from k3bundle.checklist.serving import Serving

# A stage ``st`` below is ``capacity.StageCapacity`` (its busiest rank's free bytes, latent per
# token, state per request, layer counts); capacity calls in here, so it is not imported back.


def snapshots_per_request(context: int, s: Serving) -> tuple[int, str]:
    """Snapshots a request of ``context`` tokens keeps, and the policy in words. Every N tokens:
    the states at N, 2N, ... before the last token (the state at ``context`` is the live one)."""
    if s.snapshot_every is not None:
        return (context - 1) // s.snapshot_every, (f"every {s.snapshot_every:,} tokens: floor((context − 1) / N) = "
                                                    f"floor(({context:,} − 1) / {s.snapshot_every:,})")
    if s.snapshot_turns is not None:
        return s.snapshot_turns, f"one per turn boundary: {s.snapshot_turns:,} turns"
    return 0, "no policy given (--snapshot-every N or --snapshot-turns T): none"


def prefix_cache(st, state_layer: int, latent_layer: int, tp: int, dp: int, context: int,
                 batch: int, s: Serving) -> list[Quantity]:
    """The prefix-cache budget of stage ``st`` (its busiest rank): ``state_layer`` is one KDA layer's
    state per request (all heads), ``latent_layer`` one MLA layer's latent per token, both in bytes."""
    snap = st.state_per_request
    k, policy = snapshots_per_request(context, s)
    per_req = context * st.latent_per_token + (1 + k) * snap
    left = st.free - st.batch_bytes
    per_replica = ceil_div(batch, dp)
    P = s.page_tokens
    kda_page = state_layer // tp
    mla_page = P * latent_layer
    shared = math.lcm(kda_page, mla_page)
    tail = (ceil_div(context, P) * P - context) * st.mla_layers * latent_layer
    one_size_tokens = P * ceil_div(kda_page, mla_page)
    one_size = one_size_tokens * latent_layer
    return [
        Quantity("kda_snapshot_bytes", "KDA snapshot per request per rank (every KDA layer)", snap, "B",
                 f"n_kda × (recurrent + conv) / tp = {st.kda_layers} × {state_layer:,} / {tp}"),
        Quantity("snapshots_per_request", f"snapshots per request of {context:,} tokens", k, "snapshots", policy),
        Quantity("cache_bytes_per_request_with_snapshots", "cache + live state + snapshots per request", per_req, "B",
                 f"context × latent + (1 + snapshots) × snapshot = {context:,} × {st.latent_per_token:,} + "
                 f"{1 + k} × {snap:,}"),
        Quantity("requests_fit_with_snapshots", f"requests of {context:,} tokens that fit with their snapshots",
                 dp * floor_div(st.free, per_req), "requests",
                 f"attention_dp × floor(free / per request with snapshots) = {dp} × floor({st.free:,} / {per_req:,})"),
        Quantity("snapshots_fit_beside_batch", f"snapshots that fit beside the cache of batch {batch:,}, per replica",
                 floor_div(left, snap) if snap else None, "snapshots",
                 f"floor((free − batch cache) / snapshot) = floor(({st.free:,} − {st.batch_bytes:,}) / {snap:,})"
                 if snap else "no KDA layer in the stage: nothing to snapshot"),
        Quantity("snapshots_for_batch", "snapshots the policy keeps for the batch, per replica", per_replica * k,
                 "snapshots", f"ceil(batch / attention_dp) × snapshots per request = {per_replica:,} × {k:,}"),
        Quantity("kda_state_page_bytes", "KDA state page (one layer, one request, per rank)", kda_page, "B",
                 f"(recurrent + conv) / tp = {state_layer:,} / {tp}"),
        Quantity("mla_page_bytes", f"MLA page of {P} tokens (one layer)", mla_page, "B",
                 f"page tokens × latent per layer = {P} × {latent_layer:,}"),
        Quantity("shared_page_bytes", "shared page for both kinds (JENGA)", shared, "B",
                 f"lcm(KDA page, MLA page) = lcm({kda_page:,}, {mla_page:,}) = {shared // kda_page:,} KDA pages = "
                 f"{shared // mla_page:,} MLA pages"),
        Quantity("shared_page_fragmentation", "shared pages left part-filled, at most", 2 * shared / st.free
                 if st.free > 0 else None, "ratio",
                 f"one part-filled shared page per kind: 2 × {shared:,} / free {st.free:,}"),
        Quantity("mla_tail_bytes", f"last MLA page's unused tail at {context:,} tokens", tail, "B",
                 f"(ceil(context / P) × P − context) × n_mla × latent per layer = "
                 f"({ceil_div(context, P):,} × {P} − {context:,}) × {st.mla_layers} × {latent_layer:,}"),
        Quantity("one_size_page_waste", f"one page size instead (MLA page of {one_size_tokens:,} tokens, "
                                        "KDA state padded to it)", (one_size - kda_page) / one_size, "ratio",
                 f"(page − KDA page) / page, page = P × ceil(KDA page / MLA page) tokens × latent per layer = "
                 f"{one_size_tokens:,} × {latent_layer:,} = {one_size:,}: ({one_size:,} − {kda_page:,}) / {one_size:,}"),
    ]


def handoff(stages: list, n_kda: int, n_mla: int, state_layer: int, latent_layer: int,
            context: int, s: Serving) -> list[Quantity]:
    """The prefill→decode handoff of one request of ``context`` tokens, beside a pure-MLA model of
    the same depth (``n_kda + n_mla`` MLA layers, the same latent per layer, no state)."""
    layers = n_kda + n_mla
    latent = context * n_mla * latent_layer
    states = n_kda * state_layer
    total = latent + states
    pure = context * layers * latent_layer
    rate = s.link_gbps * 1e9 / 8  # bytes/s per rank
    # every rank of the decode instance pulls its own share at once: its stage's whole latent
    # (replicated on every TP rank) and its heads' states; the busiest rank sets the time
    busy = max(stages, key=lambda x: (context * x.latent_per_token + x.state_per_request, -x.stage))
    per_rank = context * busy.latent_per_token + busy.state_per_request
    pure_busy = max(stages, key=lambda x: ((x.kda_layers + x.mla_layers), -x.stage))
    pure_rank = context * (pure_busy.kda_layers + pure_busy.mla_layers) * latent_layer
    at = f", stage {busy.stage}" if len(stages) > 1 else ""
    return [
        Quantity("handoff_latent_bytes", f"MLA latent of a request of {context:,} tokens (one copy)", latent, "B",
                 f"context × n_mla × latent per layer = {context:,} × {n_mla} × {latent_layer:,}"),
        Quantity("handoff_state_bytes", "KDA states of a request (every head)", states, "B",
                 f"n_kda × (recurrent + conv) = {n_kda} × {state_layer:,}"),
        Quantity("handoff_bytes", "handoff per request: latent + states", total, "B", f"{latent:,} + {states:,}"),
        Quantity("handoff_bytes_pure_mla", f"the same request, pure-MLA model of the same depth ({layers} MLA layers)",
                 pure, "B", f"context × layers × latent per layer = {context:,} × {layers} × {latent_layer:,}"),
        Quantity("handoff_ratio", "handoff / pure-MLA handoff", total / pure, "ratio", f"{total:,} / {pure:,}"),
        Quantity("handoff_bytes_per_rank", f"handoff per rank (busiest{at})", per_rank, "B",
                 f"context × latent per token per rank + state per request per rank = {context:,} × "
                 f"{busy.latent_per_token:,} + {busy.state_per_request:,}"),
        Quantity("handoff_seconds", f"handoff time at {s.link_gbps:g} Gbit/s per rank", per_rank / rate, "s",
                 f"bytes per rank × 8 / link = {per_rank:,} × 8 / {s.link_gbps:g}e9 (--link-gbps; ranks in parallel)"),
        Quantity("handoff_seconds_pure_mla", f"pure-MLA handoff time at {s.link_gbps:g} Gbit/s per rank",
                 pure_rank / rate, "s",
                 f"context × layers per stage × latent per layer × 8 / link = {context:,} × "
                 f"{pure_busy.kda_layers + pure_busy.mla_layers} × {latent_layer:,} × 8 / {s.link_gbps:g}e9"),
    ]
