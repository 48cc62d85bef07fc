"""Typed view of a released-style Kimi K3 ``config.json``.

The file nests ``text_config`` (with ``linear_attn_config`` and ``quantization_config``
inside it) and ``vision_config`` under the top level (docs/kimi-k3.md §1). Parsing checks
every field's type, that the fields k3bundle needs are present, and the cross-field rules
that make the shapes possible; each failure is one ``ConfigError`` naming the field.

Unknown fields are kept (``extra``) rather than rejected: a config may grow fields that
do not change the tensor schema, and ``config.json`` is copied into bundles byte-identical.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3bundle.errors import ConfigError, JsonFileError
from k3bundle.file_names import CONFIG
from k3bundle.io.strict_json import dotted, nonfinite_problem, read_json


@dataclass(frozen=True)
class LinearAttnConfig:
    """``text_config.linear_attn_config``: the KDA layers (docs/kimi-k3.md §1.2)."""

    num_heads: int
    head_dim: int
    short_conv_kernel_size: int
    gate_lower_bound: float
    use_full_rank_gate: bool
    full_attn_layers: list[int]  # 1-based, as in the release
    kda_layers: list[int]  # 1-based
    extra: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class QuantWeights:
    num_bits: int
    type: str
    symmetric: bool
    strategy: str
    group_size: int
    scale_dtype: str | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class QuantizationConfig:
    """``text_config.quantization_config`` (compressed-tensors; docs/kimi-k3.md §1.2)."""

    quant_method: str
    format: str
    weights: QuantWeights
    ignore: list[str]
    extra: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class TextConfig:
    """``text_config``: the language model (docs/kimi-k3.md §1.2)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int
    routed_scaling_factor: float
    hidden_act: str
    activation_situ_beta: float
    activation_situ_linear_beta: float
    rms_norm_eps: float
    attn_res_block_size: int
    linear_attn_config: LinearAttnConfig
    quantization_config: QuantizationConfig | None = None
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    latent_moe_use_norm: bool = True
    moe_renormalize: bool = True
    moe_router_activation_func: str = "sigmoid"
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived facts (docs/kimi-k3.md §1.2), computed, never stored in the file ----
    def is_mla(self, layer: int) -> bool:
        """Layer ``layer`` (0-based) is Gated MLA; the config's lists are 1-based."""
        return (layer + 1) in self.linear_attn_config.full_attn_layers

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def mla_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_mla(i)]

    @property
    def kda_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.is_mla(i)]

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe(i)]

    @property
    def a_log_len(self) -> int:
        """A_log is stored zero-padded to a multiple of 128 (docs/kimi-k3.md §2.3)."""
        return 128 * math.ceil(self.linear_attn_config.num_heads / 128)

    @property
    def block_openings(self) -> list[int]:
        """Layers that open a new AttnRes block (docs/kimi-k3.md (A2) step 2)."""
        return list(range(0, self.num_hidden_layers, self.attn_res_block_size))

    @property
    def mxfp4_group(self) -> int:
        q = self.quantization_config
        return q.weights.group_size if q is not None else 32


@dataclass(frozen=True)
class VisionConfig:
    """``vision_config``: MoonViT-V2 and its projector (docs/kimi-k3.md §1.3)."""

    vt_hidden_size: int
    vt_intermediate_size: int
    vt_num_hidden_layers: int
    vt_num_attention_heads: int
    qkv_hidden_size: int
    patch_size: int
    init_pos_emb_height: int
    init_pos_emb_width: int
    merge_kernel_size: list[int]
    mm_hidden_size: int
    text_hidden_size: int
    projector_ln_eps: float = 1e-5
    patch_embed_proj_bias: bool = False
    attn_bias: bool = False
    linear_bias: bool = False
    # the choices the executor's vision math is written for (docs/kimi-k3.md §3.9); it refuses others
    init_pos_emb_time: int = 4
    pos_emb_type: str = "divided_fixed"
    pos_emb_interpolation_mode: str = "bilinear"
    norm_type: str = "rmsnorm"
    activation_func: str = "gelu_pytorch_tanh"
    mlp_type: str = "mlp2"
    merge_type: str = "sd2_tpool"
    mm_projector_type: str = "patchmergerv2"
    projector_hidden_act: str = "gelu"
    extra: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class K3Config:
    """The whole ``config.json``; ``raw`` keeps the parsed JSON as read."""

    model_type: str
    text: TextConfig
    vision: VisionConfig | None
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    media_placeholder_token_id: int | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)
    source: str = field(default=CONFIG, compare=False)


# --------------------------------------------------------------------------------------
# Parsing: one generic pass driven by the dataclass field types, then cross-field rules.


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:  # JSON writes 1.0 as 1 in some exporters
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if tp is dict or origin is dict or dataclasses.is_dataclass(tp):
        return isinstance(value, dict)
    raise TypeError(f"unsupported config field type {tp!r}")  # a bug in this module


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(tp, str(tp))


# Sections that nest other sections, by field name.
_NESTED: dict[type, dict[str, type]] = {
    TextConfig: {"linear_attn_config": LinearAttnConfig, "quantization_config": QuantizationConfig},
    QuantizationConfig: {"weights": QuantWeights},
}


def _parse_section(cls: type, data: Any, where: str, source: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {where} must be a JSON object, got {json.dumps(data)[:80]}")
    hints = typing.get_type_hints(cls)
    nested = _NESTED.get(cls, {})
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name == "extra":
            continue
        path = f"{where}.{f.name}" if where else f.name
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{source}: required field {path} is missing")
            continue
        value = data[f.name]
        if not _type_ok(value, hints[f.name]) and f.name in nested:
            raise ConfigError(f"{source}: {path} must be a JSON object, got {json.dumps(value)}")
        if f.name in nested and value is not None:
            kwargs[f.name] = _parse_section(nested[f.name], value, path, source)
            continue
        if not _type_ok(value, hints[f.name]):
            raise ConfigError(
                f"{source}: {path} must be {_type_name(hints[f.name])}, got {json.dumps(value)}"
            )
        kwargs[f.name] = float(value) if hints[f.name] is float else value
    known = {f.name for f in dataclasses.fields(cls)}
    if "extra" in known:
        kwargs["extra"] = {k: v for k, v in data.items() if k not in known}
    return cls(**kwargs)


def _lift_quant_weights(text_config: Any) -> Any:
    """compressed-tensors keeps the weight scheme at config_groups.group_0.weights."""
    if not isinstance(text_config, dict) or not isinstance(text_config.get("quantization_config"), dict):
        return text_config
    qc = dict(text_config["quantization_config"])
    group0 = (qc.get("config_groups") or {}).get("group_0") if isinstance(qc.get("config_groups"), dict) else None
    if "weights" not in qc and isinstance(group0, dict) and "weights" in group0:
        qc["weights"] = group0["weights"]
    elif "weights" not in qc:
        qc["weights"] = None  # reported below as a missing/mistyped field
    return {**text_config, "quantization_config": qc}


# Bounds far above any released or planned model (the release: 93 layers, hidden 7168, vocab
# 163,840, 896 experts) and far below what would exhaust memory while the schema is listed.
MAX_LAYERS = 4096
MAX_DIM = 1 << 22  # any width, head count, rank or expert count
MAX_VOCAB = 1 << 24


def _check_bounds(t: TextConfig, src: str) -> None:
    for name, limit in (("num_hidden_layers", MAX_LAYERS), ("vocab_size", MAX_VOCAB)):
        v = getattr(t, name)
        _require(v <= limit, src, f"text_config.{name} is {v}, above the supported {limit:,}")
    for f in dataclasses.fields(t):
        v = getattr(t, f.name)
        if f.name in ("num_hidden_layers", "vocab_size") or isinstance(v, bool):
            continue
        if isinstance(v, int):
            _require(v <= MAX_DIM, src, f"text_config.{f.name} is {v}, above the supported {MAX_DIM:,}")
    la = t.linear_attn_config
    for name in ("num_heads", "head_dim", "short_conv_kernel_size"):
        v = getattr(la, name)
        _require(v <= MAX_DIM, src, f"text_config.linear_attn_config.{name} is {v}, above the supported {MAX_DIM:,}")


def _require(cond: bool, source: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{source}: {message}")


def _check_text(t: TextConfig, src: str) -> None:
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                 "v_head_dim", "intermediate_size", "num_experts", "num_experts_per_token",
                 "moe_intermediate_size", "routed_expert_hidden_size", "attn_res_block_size"):
        _require(getattr(t, name) > 0, src, f"text_config.{name} must be positive, got {getattr(t, name)}")
    _require(t.qk_rope_head_dim >= 0, src, "text_config.qk_rope_head_dim must be >= 0")
    _require(t.rms_norm_eps > 0, src, f"text_config.rms_norm_eps must be positive, got {t.rms_norm_eps}")
    _require(t.num_attention_heads % t.num_key_value_heads == 0, src,
             f"text_config.num_key_value_heads ({t.num_key_value_heads}) must divide "
             f"num_attention_heads ({t.num_attention_heads})")
    _require(t.num_attention_heads == t.num_key_value_heads, src,
             "text_config.num_key_value_heads must equal num_attention_heads for Gated MLA "
             f"(got {t.num_key_value_heads} and {t.num_attention_heads})")
    _require(t.num_experts_per_token <= t.num_experts, src,
             f"text_config.num_experts_per_token ({t.num_experts_per_token}) exceeds num_experts ({t.num_experts})")
    _require(0 <= t.first_k_dense_replace <= t.num_hidden_layers, src,
             f"text_config.first_k_dense_replace ({t.first_k_dense_replace}) must lie in 0..num_hidden_layers")
    _require(t.moe_layer_freq == 1, src,
             f"text_config.moe_layer_freq must be 1 (Kimi K3), got {t.moe_layer_freq}")
    _require(t.num_nextn_predict_layers == 0, src,
             "text_config.num_nextn_predict_layers must be 0: the release has no MTP weights")
    _require(t.hidden_act == "situ", src, f"text_config.hidden_act must be \"situ\", got {t.hidden_act!r}")
    _require(t.moe_router_activation_func == "sigmoid", src,
             f"text_config.moe_router_activation_func must be \"sigmoid\", got {t.moe_router_activation_func!r}")

    la = t.linear_attn_config
    _require(la.num_heads > 0 and la.head_dim > 0, src,
             "text_config.linear_attn_config.num_heads and head_dim must be positive")
    _require(la.short_conv_kernel_size >= 1, src,
             "text_config.linear_attn_config.short_conv_kernel_size must be >= 1")
    n = t.num_hidden_layers
    full, kda = set(la.full_attn_layers), set(la.kda_layers)
    bad = sorted(x for x in full | kda if not 1 <= x <= n)
    if bad:
        raise ConfigError(f"{src}: text_config.linear_attn_config lists layer {bad[0]} outside 1..{n} "
                          "(the lists are 1-based)")
    _require(len(full) == len(la.full_attn_layers) and len(kda) == len(la.kda_layers), src,
             "text_config.linear_attn_config.full_attn_layers/kda_layers repeat a layer")
    both = sorted(full & kda)
    if both:
        raise ConfigError(f"{src}: text_config.linear_attn_config: layer {both[0]} is in both "
                          "full_attn_layers and kda_layers")
    missing = sorted(set(range(1, n + 1)) - full - kda)
    if missing:
        raise ConfigError(f"{src}: text_config.linear_attn_config: layer {missing[0]} (1-based) is in "
                          "neither full_attn_layers nor kda_layers")

    q = t.quantization_config
    if q is not None:
        g = q.weights.group_size
        _require(g > 0, src, f"text_config.quantization_config.weights.group_size must be positive, got {g}")
        _require(q.weights.num_bits == 4 and q.weights.type == "float", src,
                 "text_config.quantization_config.weights must be 4-bit float (MXFP4)")
        for name in ("routed_expert_hidden_size", "moe_intermediate_size"):
            width = getattr(t, name)
            _require(width % g == 0, src,
                     f"text_config.quantization_config group_size ({g}) must divide {name} ({width})")


def _check_vision(v: VisionConfig, text: TextConfig, src: str) -> None:
    for name in ("vt_hidden_size", "vt_intermediate_size", "vt_num_hidden_layers",
                 "vt_num_attention_heads", "qkv_hidden_size", "patch_size", "mm_hidden_size"):
        _require(getattr(v, name) > 0, src, f"vision_config.{name} must be positive, got {getattr(v, name)}")
    _require(v.qkv_hidden_size % v.vt_num_attention_heads == 0, src,
             f"vision_config.vt_num_attention_heads ({v.vt_num_attention_heads}) must divide "
             f"qkv_hidden_size ({v.qkv_hidden_size})")
    _require(len(v.merge_kernel_size) == 2 and all(k > 0 for k in v.merge_kernel_size), src,
             f"vision_config.merge_kernel_size must be two positive integers, got {v.merge_kernel_size}")
    _require(v.text_hidden_size == text.hidden_size, src,
             f"vision_config.text_hidden_size ({v.text_hidden_size}) must equal text_config.hidden_size ({text.hidden_size})")
    _require(v.mm_hidden_size == v.vt_hidden_size, src,
             f"vision_config.mm_hidden_size ({v.mm_hidden_size}) must equal vt_hidden_size ({v.vt_hidden_size})")


def parse_config(data: Any, source: str = CONFIG) -> K3Config:
    """Parse and check a released-style config dict.

    Args:
        data (`dict`): the JSON object of ``config.json``.
        source (`str`): the file name used in error messages.

    Returns:
        `K3Config`. Raises `ConfigError` naming the field on any problem.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a JSON object")
    bad = nonfinite_problem(data)  # a dict from YAML (presets) may hold .nan; JSON text is refused earlier
    if bad:
        raise ConfigError(f"{source}: {bad}")
    if "text_config" not in data:
        raise ConfigError(f"{source}: required field text_config is missing (a text-only "
                          "kimi_linear config is not a Kimi K3 release config)")
    text = _parse_section(TextConfig, _lift_quant_weights(data["text_config"]), "text_config", source)
    _check_bounds(text, source)
    _check_text(text, source)

    vision = None
    if data.get("vision_config") is not None:
        vision = _parse_section(VisionConfig, data["vision_config"], "vision_config", source)
        _check_vision(vision, text, source)

    def _int(name: str, required: bool = True):
        v = data.get(name)
        if v is None and not required:
            return None
        if not _type_ok(v, int):
            raise ConfigError(f"{source}: {name} must be an integer, got {json.dumps(v)}")
        if not 0 <= v < text.vocab_size:
            raise ConfigError(f"{source}: {name} ({v}) must lie in 0..vocab_size-1 ({text.vocab_size - 1})")
        return v

    model_type = data.get("model_type")
    if model_type != "kimi_k3":
        raise ConfigError(f"{source}: model_type must be \"kimi_k3\", got {json.dumps(model_type)}")
    return K3Config(
        model_type=model_type, text=text, vision=vision,
        bos_token_id=_int("bos_token_id"), eos_token_id=_int("eos_token_id"),
        pad_token_id=_int("pad_token_id"),
        media_placeholder_token_id=_int("media_placeholder_token_id", required=False),
        raw=data, source=source,
    )


def load_config(path: str | Path) -> K3Config:
    """Read ``config.json`` (or a checkpoint directory containing one) and parse it."""
    p = Path(path)
    if p.is_dir():
        p = p / CONFIG
    try:
        data = read_json(p)
    except JsonFileError as e:
        if e.key is None:
            raise ConfigError(str(e)) from None
        # config messages quote JSON text as JSON (``"hidden_size"``), as they quote values
        raise ConfigError(f"{e.file}: duplicate key {json.dumps(e.key)}"
                          + (f" in {dotted(e.at)}" if e.at else "")) from None
    return parse_config(data, source=str(p))


def release_config_path() -> Path:
    """The released Kimi K3 config.json (no weights), shipped as package data."""
    return Path(__file__).parent / "data" / "kimi-k3.config.json"
