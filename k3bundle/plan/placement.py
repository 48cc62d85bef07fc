"""Place every tensor of the schema on the ranks of a layout: shapes only, no weight I/O.

Ranks: ``rank = stage * R + local`` with ``R = tp * attention_dp`` ranks per pipeline stage.
Attention and dense weights: ``tp_rank = local % tp`` (attention-DP replicas hold identical
slices). Routed experts (TensorRT-LLM ``Mapping`` convention): ``ep_rank = local % ep``,
``moe_tp_rank = local // ep``; EP rank k holds experts ``[k E/ep, (k+1) E/ep)`` (contiguous).
Pipeline: decoder layers by ``Layout.stage_layers``; the embedding and the vision tower +
projector sit on stage 0, ``lm_head``, the final norm and the output AttnRes on the last.

The unit of placement is a ``Target``: one role instance (a tensor, an MXFP4 pair, or a
*family* of routed experts) on one rank, with the slice it takes. Full K3 is ~3,600 role
instances, so a plan is tens of thousands of targets however many experts there are.

Rules (``docs/layouts.md``), checked together and raised once as ``LayoutError``:
``tp-divides-kda-heads``, ``tp-divides-mla-heads``, ``tp-divides-dense-intermediate``,
``tp-divides-shared-intermediate``, ``tp-divides-vocab``, ``ep-divides-experts``,
``moe-tp-divides-expert-intermediate``, ``mxfp4-slice-on-block``, ``padding-mxfp4-block``,
``pp-covers-layers``, ``parts-in-one-shard``, ``stack-experts-one-shard``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from k3bundle.config import K3Config
from k3bundle.formats import mxfp4
from k3bundle.layouts import FormatRule, Layout, LayoutError
from k3bundle.plan.storage import DevicePart, device_parts, storage_format
from k3bundle.schema import RELEASE_PREFIX, TP, Role, Schema, Scope, Section, TensorSpec
from k3bundle.checkpoint import SourceCheckpoint

# unit -> (rule name, what the unit counts, config field), for the TP divisibility rules
_UNIT_RULES = {
    "H": ("tp-divides-kda-heads", "the KDA heads H", "text_config.linear_attn_config.num_heads"),
    "Hm": ("tp-divides-mla-heads", "the MLA heads", "text_config.num_attention_heads"),
    "I": ("tp-divides-dense-intermediate", "the dense intermediate size I", "text_config.intermediate_size"),
    "S": ("tp-divides-shared-intermediate", "the shared-expert intermediate S",
          "num_shared_experts x moe_intermediate_size"),
    "V": ("tp-divides-vocab", "the vocabulary V", "text_config.vocab_size"),
}
_LAST_STAGE_ROLES = ("lm_head", "final_norm", "out_res.norm", "out_res.proj")


@dataclass(frozen=True, slots=True)
class RankInfo:
    rank: int
    stage: int
    tp_rank: int
    dp_rank: int
    ep_rank: int
    moe_tp_rank: int


@dataclass(frozen=True, slots=True)
class Target:
    """One role instance (tensor, MXFP4 pair or expert family) placed on one rank."""

    rank: int
    role: Role
    layer: int | None
    rule: FormatRule
    split: str  # "none", "rows" (dim 0, column-parallel) or "cols" (dim 1, row-parallel)
    start: int  # slice along the split dim, logical elements ([0, dim0) when not split)
    stop: int
    pad: int  # zero rows/cols appended along the split dim
    experts: tuple[int, int] | None  # [first, stop) of a routed-expert family
    shard: str  # source file holding this instance's tensors

    @property
    def n_experts(self) -> int:
        return 1 if self.experts is None else self.experts[1] - self.experts[0]

    def expert_ids(self) -> range | tuple[None]:
        return (None,) if self.experts is None else range(*self.experts)


class Plan:
    """Every target of a config under a layout, with per-rank byte totals."""

    def __init__(self, config: K3Config, layout: Layout, schema: Schema, ranks: list[RankInfo],
                 targets: list[Target], stage_layers: tuple[int, ...]):
        self.config = config
        self.layout = layout
        self.schema = schema
        self.ranks = ranks
        self.targets = targets
        self.stage_layers = stage_layers
        self._parts: dict[tuple, list[DevicePart]] = {}

    # ---- shapes ----
    def slice_shape(self, t: Target) -> tuple[int, ...]:
        """Logical shape of one weight's device slice, padding included."""
        shape = list(self.schema.logical_shape(t.role))
        if t.role.padded and t.split == "none":
            shape[0] = self.schema.dims[t.role.unit]  # A_log: the real heads, never the zero padding
        if t.split == "rows":
            shape[0] = t.stop - t.start + t.pad
        elif t.split == "cols":
            shape[1] = t.stop - t.start + t.pad
        return tuple(shape)

    def parts(self, t: Target) -> list[DevicePart]:
        """The device tensors of one weight of ``t`` (per expert for a family)."""
        shape = self.slice_shape(t)
        key = (t.role.role, t.rule, shape)
        got = self._parts.get(key)
        if got is None:
            dtype = self.schema.stored_dtype(t.role, "weight")
            got = self._parts[key] = device_parts(t.role, t.rule, self.layout.swizzled, shape, dtype)
        return got

    def target_bytes(self, t: Target) -> int:
        return sum(p.nbytes for p in self.parts(t)) * t.n_experts

    def stacked(self, t: Target) -> bool:
        return t.experts is not None and self.layout.stack_experts

    # ---- totals ----
    @cached_property
    def rank_bytes(self) -> list[int]:
        out = [0] * len(self.ranks)
        for t in self.targets:
            out[t.rank] += self.target_bytes(t)
        return out

    @cached_property
    def rank_breakdown(self) -> list[dict[str, int]]:
        """Bytes per rank by group: routed_experts, attention, ffn, embedding, vision, other."""
        out: list[dict[str, int]] = [dict.fromkeys(GROUPS, 0) for _ in self.ranks]
        for t in self.targets:
            out[t.rank][role_group(t.role)] += self.target_bytes(t)
        return out

    @property
    def usable_bytes(self) -> int:
        return self.layout.card.hbm_bytes - self.layout.runtime_reserve_bytes

    @property
    def fits(self) -> bool:
        return max(self.rank_bytes) <= self.usable_bytes

    @cached_property
    def stage_of_layer(self) -> list[int]:
        """The pipeline stage of each decoder layer."""
        return _stage_of_layer(self.stage_layers)

    @cached_property
    def shards(self) -> list[str]:
        return sorted({t.shard for t in self.targets})

    @cached_property
    def by_shard(self) -> dict[str, list[Target]]:
        out: dict[str, list[Target]] = {s: [] for s in self.shards}
        for t in self.targets:
            out[t.shard].append(t)
        return out

    def summary(self) -> dict:
        """Per-rank bytes against the card (the body of ``plan --json``)."""
        lay = self.layout
        ranks = []
        for info, used, groups in zip(self.ranks, self.rank_bytes, self.rank_breakdown):
            ranks.append({"rank": info.rank, "stage": info.stage, "tp_rank": info.tp_rank,
                          "dp_rank": info.dp_rank, "ep_rank": info.ep_rank, "moe_tp_rank": info.moe_tp_rank,
                          "weight_bytes": used, "by_group": groups,
                          "headroom_bytes": self.usable_bytes - used, "fits": used <= self.usable_bytes})
        worst = max(range(len(self.ranks)), key=lambda r: self.rank_bytes[r])
        return {
            "schema_version": 1,
            "target": lay.name,
            "cards": {"name": lay.card.name, "count": lay.card.count, "hbm_bytes": lay.card.hbm_bytes},
            "parallel": {"tp": lay.parallel.tp, "attention_dp": lay.parallel.attention_dp,
                         "ep": lay.parallel.ep, "moe_tp": lay.parallel.moe_tp, "pp": lay.parallel.pp,
                         "pp_layers": list(self.stage_layers)},
            "usable_bytes_per_card": self.usable_bytes,
            "runtime_reserve_bytes": lay.runtime_reserve_bytes,
            "total_device_bytes": sum(self.rank_bytes),
            "source_bytes": self.schema.totals.stored_bytes,
            "max_rank_bytes": self.rank_bytes[worst],
            "worst_rank": worst,
            "fits": self.fits,
            "targets": len(self.targets),
            "ranks": ranks,
        }


GROUPS = ("routed_experts", "attention", "ffn", "embedding", "vision", "other")


def role_group(role: Role) -> str:
    if role.scope is Scope.EXPERT:
        return "routed_experts"
    if role.section is not Section.TEXT:
        return "vision"
    if role.role in ("embed", "lm_head"):
        return "embedding"
    head = role.role.split(".")[0]
    if head in ("kda", "mla"):
        return "attention"
    if head in ("dense", "moe"):
        return "ffn"
    return "other"


# ------------------------------------------------------------------------------------------


class _Problems(list):
    def add(self, rule: str, message: str) -> None:
        if (rule, message) not in self:
            self.append((rule, message))


def _stage_of_layer(stage_layers: tuple[int, ...]) -> list[int]:
    out = []
    for s, n in enumerate(stage_layers):
        out += [s] * n
    return out


def _check_degrees(schema: Schema, layout: Layout, problems: _Problems) -> tuple[int, ...]:
    dims, par = schema.dims, layout.parallel
    for unit, (rule, what, field) in _UNIT_RULES.items():
        if dims[unit] % par.tp:
            problems.add(rule, f"tp ({par.tp}) must divide {what} ({dims[unit]}, {field})")
    if dims["E"] % par.ep:
        problems.add("ep-divides-experts", f"ep ({par.ep}) must divide the routed experts "
                                           f"({dims['E']}, text_config.num_experts)")
    if dims["Ie"] % par.moe_tp:
        problems.add("moe-tp-divides-expert-intermediate",
                     f"moe_tp = tp x attention_dp / ep ({par.moe_tp}) must divide the expert intermediate "
                     f"Ie ({dims['Ie']}, text_config.moe_intermediate_size)")
    elif (dims["Ie"] // par.moe_tp) % mxfp4.BLOCK:
        problems.add("mxfp4-slice-on-block",
                     f"a TP slice of the MXFP4 expert w2 ({dims['Ie']} / moe_tp {par.moe_tp} = "
                     f"{dims['Ie'] // par.moe_tp} columns) must be whole {mxfp4.BLOCK}-element blocks")
    n = schema.n_layers
    stages = layout.stage_layers(n)
    if par.pp > n:
        problems.add("pp-covers-layers", f"pp ({par.pp}) exceeds the decoder layers ({n})")
    elif sum(stages) != n or min(stages) < 1:
        problems.add("pp-covers-layers", f"parallel.pp_layers {list(stages)} must be positive and sum to the "
                                         f"decoder layers ({n})")
    return stages


def _split(role: Role, schema: Schema, layout: Layout, degree: int, rank: int
           ) -> tuple[str, int, int, int]:
    """(split, start, stop, pad) of ``rank``'s slice of ``role`` at TP ``degree``."""
    shape = schema.logical_shape(role)
    if role.tp is TP.REPLICATE:
        return "none", 0, shape[0] if shape else 1, 0
    dim = 1 if role.tp is TP.ROW else 0
    full = schema.dims[role.unit] if role.padded else shape[dim]
    per = full // degree
    mult = layout.padding.get(role.unit)
    pad = (-per) % mult if mult else 0
    if degree == 1 and pad == 0:  # whole tensor; a padded role (A_log) keeps only its real rows
        return "none", 0, full if dim == 0 else shape[0], 0
    return ("cols" if dim == 1 else "rows"), rank * per, (rank + 1) * per, pad


def make_plan(config: K3Config, layout: Layout, shard_of: Callable[[TensorSpec], str] | None = None,
              prefix: str = RELEASE_PREFIX) -> Plan:
    """Place every tensor of ``config`` under ``layout``; raise ``LayoutError`` on broken rules.

    Args:
        config: the model config.
        layout: a parsed layout (``load_layout``).
        shard_of: source file of a stored tensor; defaults to the release's shard layout
            (``Schema.shard_name``), for planning from a config alone.
        prefix: text tensor prefix (``language_model.`` in the release).
    """
    schema = Schema(config, prefix=prefix)
    problems = _Problems()
    stages = _check_degrees(schema, layout, problems)
    if problems:
        _raise(layout, problems)
    layout = layout.resolved(schema.n_layers)
    par = layout.parallel
    R = par.stage_ranks
    stage_of = _stage_of_layer(stages)
    ranks = [RankInfo(s * R + loc, s, loc % par.tp, loc // par.tp, loc % par.ep, loc // par.ep)
             for s in range(par.pp) for loc in range(R)]
    per_expert = shard_of is not None  # a real index may put experts anywhere; the release rule does not
    if shard_of is None:
        def shard_of(spec: TensorSpec) -> str:
            return schema.shard_name(schema.shard_index(spec))

    targets: list[Target] = []
    for role, layer in schema.instances():
        rule = layout.rule_for(role)
        if role.section is not Section.TEXT:
            stage = 0
        elif layer is not None:
            stage = stage_of[layer]
        else:
            stage = par.pp - 1 if role.role in _LAST_STAGE_ROLES else 0
        if role.scope is Scope.EXPERT:
            targets += _expert_targets(schema, layout, role, layer, rule, stage, shard_of, per_expert,
                                       problems)
            continue
        shards = {shard_of(spec) for spec in schema.specs(role, layer)}
        if len(shards) > 1:
            problems.add("parts-in-one-shard", f"{role.role} of layer {layer}: its stored parts lie in "
                                               f"{len(shards)} source files ({', '.join(sorted(shards))})")
        shard = min(shards)
        for loc in range(R):
            split, a, b, pad = _split(role, schema, layout, par.tp, loc % par.tp)
            targets.append(Target(stage * R + loc, role, layer, rule, split, a, b, pad, None, shard))
    plan = Plan(config, layout, schema, ranks, targets, stages)
    _check_blocks(plan, problems)
    if problems:
        _raise(layout, problems)
    return plan


def _expert_targets(schema: Schema, layout: Layout, role: Role, layer: int, rule: FormatRule,
                    stage: int, shard_of: Callable[[TensorSpec], str], per_expert: bool,
                    problems: _Problems) -> list[Target]:
    par = layout.parallel
    E = schema.dims["E"]
    per_ep = E // par.ep
    # runs of experts by source file; a family never spans two files
    runs: list[tuple[int, int, str]] = []
    for e in (range(E) if per_expert else (0,)):
        shards = {shard_of(spec) for spec in schema.specs(role, layer, e)}
        if len(shards) > 1:
            problems.add("parts-in-one-shard", f"{role.role} of layer {layer} expert {e}: packed and scale "
                                               f"lie in different source files")
        s = min(shards)
        if runs and runs[-1][2] == s and runs[-1][1] == e:
            runs[-1] = (runs[-1][0], e + 1, s)
        else:
            runs.append((e, e + 1, s))
    if not per_expert:  # planning from a config: the release keeps a layer's experts in one shard
        runs = [(0, E, runs[0][2])]
    out = []
    R = par.stage_ranks
    for loc in range(R):
        ep_rank, moe_tp_rank = loc % par.ep, loc // par.ep
        lo, hi = ep_rank * per_ep, (ep_rank + 1) * per_ep
        split, a, b, pad = _split(role, schema, layout, par.moe_tp, moe_tp_rank)
        pieces = [(max(lo, r0), min(hi, r1), s) for r0, r1, s in runs if r0 < hi and r1 > lo]
        if layout.stack_experts and len(pieces) > 1:
            problems.add("stack-experts-one-shard",
                         f"stack_experts needs each rank's experts of a layer in one source file, but layer "
                         f"{layer} experts {lo}..{hi - 1} span {len(pieces)} files")
        for e0, e1, s in pieces:
            out.append(Target(stage * R + loc, role, layer, rule, split, a, b, pad, (e0, e1), s))
    return out


def _check_blocks(plan: Plan, problems: _Problems) -> None:
    """Block alignment of every slice stored in a block format (one check per role, not per target)."""
    seen = set()
    for t in plan.targets:
        fmt = storage_format(t.rule, t.role)
        name = fmt.name
        key = (t.role.role, name, t.split, t.stop - t.start, t.pad)
        if key in seen:
            continue
        seen.add(key)
        block = fmt.column_block
        if not block:
            continue
        cols = plan.slice_shape(t)[1]
        if t.split == "cols" and (t.stop - t.start) % block:
            problems.add("mxfp4-slice-on-block",
                         f"{t.role.role}: a TP slice of {t.stop - t.start} columns is not whole "
                         f"{block}-element blocks of {name}")
        elif t.split == "cols" and t.pad % block:
            problems.add("padding-mxfp4-block",
                         f"{t.role.role}: padding of {t.pad} columns per rank (padding.{t.role.unit}) is not whole "
                         f"{block}-element blocks of {name}")
        elif cols % block:
            problems.add("mxfp4-slice-on-block",
                         f"{t.role.role}: {name} needs whole {block}-element blocks, but the slice has "
                         f"{cols} columns")


def _raise(layout: Layout, problems: _Problems) -> None:
    text = "; ".join(f"[{r}] {m}" for r, m in problems)
    raise LayoutError(f"layout {layout.name}: {text}", [r for r, _ in problems])


def plan_for_source(src: SourceCheckpoint, layout: Layout) -> Plan:
    """The plan of a checked source checkpoint under ``layout`` (its real shard map)."""
    weight_map = src.index.weight_map
    return make_plan(src.config, layout, shard_of=lambda spec: weight_map[spec.name], prefix=src.schema.prefix)
