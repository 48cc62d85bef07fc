"""The single source of truth for the Kimi K3 checkpoint's tensors.

``Schema(config)`` expands the role table of ``k3bundle.schema.roles`` against a config
into every stored tensor of the release — name, stored shape and dtype, logical shape,
storage format, role, layer, layer kind and TP rule — plus the release's shard layout.
synth, plan, convert, the executor's loader and the checklist all ask it; none of them
builds a tensor name by itself.

Counting (``Schema.totals``) works from the role table and the layer pattern, so full K3
(497,220 tensors) is summarised without enumerating it; ``tensors()`` enumerates lazily.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property

from k3bundle.config import K3Config
from k3bundle.errors import SchemaError
from k3bundle.schema.roles import (
    MXFP4_PARTS, ROLE_BY_NAME, ROLES, STORED_DTYPE, TP, Format, Role, Scope, Section, dimensions,
)
from k3bundle.schema.roles import STACKED_EXPERT_TEMPLATES  # noqa: F401 (re-exported)

#: Name suffix of each stored part: [MXFP4 role?] -> part -> suffix (an MXFP4 role's packed/scale
#: pair, any other role's one "weight" under its template's own name).
PART_SUFFIX = {True: {p: s for p, s, _ in MXFP4_PARTS}, False: {"weight": ""}}

__all__ = ["Schema", "TensorSpec", "Totals", "Role", "Scope", "Format", "TP", "Section", "ROLES",
           "ROLE_BY_NAME", "DTYPE_BYTES", "RELEASE_PREFIX"]

RELEASE_PREFIX = "language_model."  # multimodal release; "" for a text-only export (docs/kimi-k3.md §2.2)
DTYPE_BYTES = {"BF16": 2, "F32": 4, "U8": 1}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One stored tensor of the checkpoint."""

    name: str
    shape: tuple[int, ...]  # as stored
    dtype: str  # safetensors dtype string
    role: Role
    part: str  # "weight", or "packed"/"scale" for the two halves of an MXFP4 pair
    logical_shape: tuple[int, ...]  # dequantized shape (= shape unless MXFP4 or padded)
    layer: int | None = None  # decoder layer (text) or encoder block (vision)
    expert: int | None = None
    mixer: str | None = None  # "kda" / "mla" for decoder-layer tensors
    ffn: str | None = None  # "dense" / "moe" for decoder-layer tensors

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stem(self) -> str:
        """Name of the logical tensor: the pair stem for MXFP4 halves, else the name."""
        if self.part == "weight":
            return self.name
        suffix = dict((p, s) for p, s, _ in MXFP4_PARTS)[self.part]
        return self.name[: -len(suffix)]

    @property
    def pair_name(self) -> str | None:
        """The other half of an MXFP4 pair (packed <-> scale)."""
        if self.part == "weight":
            return None
        other = "scale" if self.part == "packed" else "packed"
        return self.stem + dict((p, s) for p, s, _ in MXFP4_PARTS)[other]

    @property
    def tp_rule(self) -> str:
        """Human-readable TP rule, e.g. "column by H (96)"."""
        r = self.role
        rule = r.tp.value if r.unit is None else f"{r.tp.value} by {r.unit}"
        return f"expert (EP places whole experts; TP: {rule})" if r.scope is Scope.EXPERT else rule


@dataclass(frozen=True)
class Totals:
    tensors: int
    stored_bytes: int
    routed_expert_bytes: int
    text_params: int  # logical (dequantized) parameters of the language model
    active_params: int  # per token: excl. embedding lookup, incl. lm_head, top-k routed experts
    vision_params: int
    projector_params: int
    text_bytes: int
    vision_projector_bytes: int


class Schema:
    """Every tensor of a Kimi K3 checkpoint for one config."""

    def __init__(self, config: K3Config, prefix: str = RELEASE_PREFIX, vision: bool = True):
        self.config = config
        self.text = config.text
        self.vision = config.vision if vision else None
        self.prefix = prefix
        self.dims = dimensions(self.text, self.vision)
        self.n_layers = self.text.num_hidden_layers

    # ---- layer pattern (docs/kimi-k3.md §1.2) ----
    def mixer(self, layer: int) -> str:
        return "mla" if self.text.is_mla(layer) else "kda"

    def ffn(self, layer: int) -> str:
        return "moe" if self.text.is_moe(layer) else "dense"

    def layer_roles(self, layer: int) -> tuple[Role, ...]:
        """The roles of decoder layer ``layer``: the shared ones, its mixer's, its FFN's."""
        return self._roles_of_kind[self.mixer(layer), self.ffn(layer)]

    @cached_property
    def _roles_of_kind(self) -> dict[tuple[str, str], tuple[Role, ...]]:
        out = {}
        for mixer in ("kda", "mla"):
            for ffn in ("dense", "moe"):
                scopes = (Scope.LAYER, Scope(mixer), Scope(ffn))
                roles = [r for r in ROLES if r.scope in scopes]
                if ffn == "moe":
                    roles += [r for r in ROLES if r.scope is Scope.EXPERT]
                out[mixer, ffn] = tuple(roles)
        return out

    @cached_property
    def _role_names_of_kind(self) -> dict[tuple[str, str], frozenset[str]]:
        return {kind: frozenset(r.role for r in roles) for kind, roles in self._roles_of_kind.items()}

    def _sections(self) -> tuple[Section, ...]:
        if self.vision is None:
            return (Section.TEXT,)
        return (Section.TEXT, Section.PROJECTOR, Section.VISION)

    # ---- shapes ----
    def logical_shape(self, role: Role) -> tuple[int, ...]:
        try:
            return tuple(self.dims[d] for d in role.shape)
        except KeyError as e:  # a vision role without a vision config: a bug in the caller
            raise SchemaError(f"role {role.role} needs dimension {e.args[0]} that the config lacks") from None

    def stored(self, role: Role) -> list[tuple[str, str, tuple[int, ...]]]:
        """(part, name suffix, stored shape) for each stored tensor of a role."""
        shape = self.logical_shape(role)
        if role.fmt is not Format.MXFP4:
            return [("weight", "", shape)]
        out, inp = shape
        g = self.text.mxfp4_group
        return [("packed", MXFP4_PARTS[0][1], (out, inp // 2)), ("scale", MXFP4_PARTS[1][1], (out, inp // g))]

    def stored_dtype(self, role: Role, part: str) -> str:
        return "U8" if role.fmt is Format.MXFP4 else STORED_DTYPE[role.fmt]

    # ---- enumeration ----
    def _specs(self, role: Role, layer: int | None = None, expert: int | None = None,
               experts: Iterable[int] | None = None) -> Iterator[TensorSpec]:
        """The stored tensors of ``role`` at ``layer`` for ``expert``, or for each of ``experts`` in
        turn: what does not depend on the expert is worked out once (496,000 of the release's
        497,220 tensors are routed experts)."""
        logical = self.logical_shape(role)
        text_layer = role.section is Section.TEXT and layer is not None
        mixer, ffn = (self.mixer(layer), self.ffn(layer)) if text_layer else (None, None)
        parts = [(part, suffix, shape, self.stored_dtype(role, part)) for part, suffix, shape in self.stored(role)]
        for eid in (expert,) if experts is None else experts:
            base = role.template.format(lm=self.prefix, bid=layer, eid=eid)
            for part, suffix, shape, dtype in parts:
                yield TensorSpec(name=base + suffix, shape=shape, dtype=dtype, role=role, part=part,
                                 logical_shape=logical, layer=layer, expert=eid, mixer=mixer, ffn=ffn)

    def layer_tensors(self, layer: int, experts: Iterable[int] | None = None) -> Iterator[TensorSpec]:
        """Stored tensors of decoder layer ``layer``; routed experts in numeric order."""
        if not 0 <= layer < self.n_layers:
            raise SchemaError(f"layer {layer} out of range 0..{self.n_layers - 1}")
        ids = range(self.text.num_experts) if experts is None else experts
        for role in self.layer_roles(layer):
            if role.scope is Scope.EXPERT:
                yield from self._specs(role, layer, experts=ids)
            else:
                yield from self._specs(role, layer)

    def global_tensors(self, section: Section = Section.TEXT) -> Iterator[TensorSpec]:
        for role in ROLES:
            if role.section is section and role.scope is Scope.GLOBAL:
                yield from self._specs(role)
        if section is Section.VISION:
            for b in range(self.vision.vt_num_hidden_layers):
                for role in ROLES:
                    if role.scope is Scope.VIT_BLOCK:
                        yield from self._specs(role, b)

    def tensors(self) -> Iterator[TensorSpec]:
        """Every stored tensor, in release shard order."""
        for layer in range(self.n_layers):
            yield from self.layer_tensors(layer)
        for section in self._sections():
            yield from self.global_tensors(section)

    # ---- release shard layout (docs/kimi-k3.md §2.1) ----
    @property
    def num_shards(self) -> int:
        return self.n_layers + len(self._sections())

    def shard_index(self, spec: TensorSpec) -> int:
        """1-based shard: layer l -> l+1; then text globals, projector, vision."""
        if spec.role.section is Section.TEXT and spec.layer is not None:
            return spec.layer + 1
        return self.n_layers + 1 + self._sections().index(spec.role.section)

    def shard_name(self, index: int) -> str:
        # 5-digit index, 6-digit total, as the release writes it (docs/kimi-k3.md §2.1, §6.1)
        return f"model-{index:05d}-of-{self.num_shards:06d}.safetensors"

    def shard_tensors(self, index: int) -> Iterator[TensorSpec]:
        if 1 <= index <= self.n_layers:
            yield from self.layer_tensors(index - 1)
        elif self.n_layers < index <= self.num_shards:
            yield from self.global_tensors(self._sections()[index - self.n_layers - 1])
        else:
            raise SchemaError(f"shard {index} out of range 1..{self.num_shards}")

    # ---- role instances and device-side names (plan / convert / trace) ----
    def instances(self) -> Iterator[tuple[Role, int | None]]:
        """Every (role, layer-or-block) in release shard order; an expert role once per MoE layer.

        This is ``tensors()`` without the expert and part expansion: full K3 has ~3,600
        instances instead of 497,220 tensors, which is what lets ``plan`` work on families.
        """
        for layer in range(self.n_layers):
            for role in self.layer_roles(layer):
                yield role, layer
        for section in self._sections():
            for role in ROLES:
                if role.section is section and role.scope is Scope.GLOBAL:
                    yield role, None
            if section is Section.VISION:
                for b in range(self.vision.vt_num_hidden_layers):
                    for role in ROLES:
                        if role.scope is Scope.VIT_BLOCK:
                            yield role, b

    def specs(self, role: Role, layer: int | None = None, expert: int | None = None) -> list[TensorSpec]:
        """The stored tensors of one role instance (one, or the packed/scale pair of MXFP4)."""
        return list(self._specs(role, layer, expert))

    def _stem_template(self, role: Role, stacked: bool) -> str:
        if stacked:
            if role.role not in STACKED_EXPERT_TEMPLATES:
                raise SchemaError(f"role {role.role} is not a routed-expert role; it cannot be stacked")
            return STACKED_EXPERT_TEMPLATES[role.role]
        if role.fmt is Format.MXFP4:
            return role.template
        if role.template.endswith(".weight"):
            return role.template[: -len(".weight")]
        raise SchemaError(f"role {role.role} ({role.template}) is not a linear weight; it has no weight stem")

    def device_name(self, role: Role, layer: int | None, expert: int | None, suffix: str,
                    stacked: bool = False) -> str:
        """Name of a device tensor derived from ``role``: its weight stem + ``suffix``.

        ``suffix`` comes from a storage format's device parts (``k3bundle.storage``, e.g.
        ``.weight_scale``). ``stacked`` names a rank's stacked experts of one layer
        (``roles.STACKED_EXPERT_TEMPLATES``); then ``expert`` must be None.
        """
        if stacked and expert is not None:
            raise SchemaError(f"a stacked name of {role.role} has no expert id (got {expert})")
        stem = self._stem_template(role, stacked)
        return stem.format(lm=self.prefix, bid=layer, eid=expert) + suffix

    def expert_name_template(self, role: Role, layer: int, suffix: str) -> str:
        """A routed-expert tensor name with the literal ``{eid}`` left in, for compact indexes."""
        if role.scope is not Scope.EXPERT:
            raise SchemaError(f"role {role.role} is not a routed-expert role")
        return self._stem_template(role, False).format(lm=self.prefix, bid=layer, eid="{eid}") + suffix

    # ---- lookup ----
    @cached_property
    def _index(self) -> dict[str, TensorSpec]:
        return {s.name: s for s in self.tensors()}

    def get(self, name: str) -> TensorSpec:
        try:
            return self._index[name]
        except KeyError:
            raise SchemaError(f"tensor {name!r} is not part of the Kimi K3 schema for this config") from None

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def name(self, role: str, layer: int | None = None, expert: int | None = None,
             part: str = "weight") -> str:
        """The stored name of one tensor of ``role`` (no enumeration of the model).

        Args:
            role (`str`): a role of ``roles.ROLES``, e.g. "kda.q_proj" or "moe.expert.w1".
            layer (`int`, optional): the decoder layer, for per-layer and per-expert roles.
            expert (`int`, optional): the routed expert, for per-expert roles.
            part (`str`): "weight", or "packed"/"scale" for the halves of an MXFP4 role.
        """
        r = ROLE_BY_NAME.get(role)
        if r is None:
            raise SchemaError(f"unknown tensor role {role!r}")
        needs_layer = r.scope not in (Scope.GLOBAL,)
        if needs_layer != (layer is not None) or (r.scope is Scope.EXPERT) != (expert is not None):
            raise SchemaError(f"role {role} (scope {r.scope.value}) got layer={layer}, expert={expert}")
        if layer is not None and r.section is Section.TEXT:
            if not 0 <= layer < self.n_layers:
                raise SchemaError(f"layer {layer} out of range 0..{self.n_layers - 1}")
            if r.role not in self._role_names_of_kind[self.mixer(layer), self.ffn(layer)]:
                raise SchemaError(f"layer {layer} ({self.mixer(layer)}/{self.ffn(layer)}) has no role {role}")
        if expert is not None and not 0 <= expert < self.text.num_experts:
            raise SchemaError(f"expert {expert} out of range 0..{self.text.num_experts - 1}")
        suffix = PART_SUFFIX[r.fmt is Format.MXFP4].get(part)  # the rule of stored(), without the shapes
        if suffix is None:
            raise SchemaError(f"role {role} has no part {part!r}")
        return r.template.format(lm=self.prefix, bid=layer, eid=expert) + suffix

    def check_keys(self, keys: Iterable[str], where: str = "checkpoint") -> None:
        """Raise once, with counts and first examples, if keys differ from the schema."""
        keys = set(keys)
        unknown = sorted(k for k in keys if k not in self._index)
        missing = sorted(k for k in self._index if k not in keys)
        problems = []
        if unknown:
            problems.append(f"{len(unknown)} unknown tensor(s), first {unknown[0]!r}")
        if missing:
            problems.append(f"{len(missing)} missing tensor(s), first {missing[0]!r}")
        if problems:
            raise SchemaError(f"{where}: " + "; ".join(problems))

    # ---- totals, from the role table (no enumeration) ----
    def _multiplicity(self, role: Role) -> int:
        t = self.text
        n = self.n_layers
        return {
            Scope.GLOBAL: 1,
            Scope.LAYER: n,
            Scope.KDA: len(t.kda_layers),
            Scope.MLA: len(t.mla_layers),
            Scope.DENSE: n - len(t.moe_layers),
            Scope.MOE: len(t.moe_layers),
            Scope.EXPERT: len(t.moe_layers) * t.num_experts,
            Scope.VIT_BLOCK: self.vision.vt_num_hidden_layers if self.vision else 0,
        }[role.scope]

    def _params(self, role: Role) -> int:
        # A_log counts its stored (zero-padded) length, as the release's parameter total does
        return math.prod(self.logical_shape(role))

    @cached_property
    def totals(self) -> Totals:
        count = nbytes = expert_bytes = text_params = vis_params = proj_params = 0
        text_bytes = vp_bytes = embed = routed = 0
        for role in ROLES:
            if role.section is not Section.TEXT and self.vision is None:
                continue
            m = self._multiplicity(role)
            stored = self.stored(role)
            b = sum(math.prod(s) * DTYPE_BYTES[self.stored_dtype(role, p)] for p, _, s in stored) * m
            count += len(stored) * m
            nbytes += b
            p = self._params(role) * m
            if role.section is Section.TEXT:
                text_params += p
                text_bytes += b
            else:
                vp_bytes += b
                if role.section is Section.VISION:
                    vis_params += p
                else:
                    proj_params += p
            if role.scope is Scope.EXPERT:
                expert_bytes += b
                routed += p
            if role.role == "embed":
                embed += p
        t = self.text
        active = text_params - embed - routed + routed * t.num_experts_per_token // t.num_experts
        return Totals(count, nbytes, expert_bytes, text_params, active, vis_params, proj_params,
                      text_bytes, vp_bytes)
