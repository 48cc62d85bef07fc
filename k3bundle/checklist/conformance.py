"""Each kernel's conformance status, read from the sign-off: the checks that exercise the op.

An op is exercised by the taps downstream of it in the layers that call it (``OP_EVIDENCE``):
the KDA kernels by ``mixer_out`` of KDA layers, the router by the expert sets of MoE layers, and
so on. Prefill ops are judged by the teacher-forced layer checks (modes "added", "emulation",
"router"), which locate an error to the layer that adds it; decode ops by the checks of the decode
taps (``decode.…``). A kernel no check exercises is "untested", never "pass".
"""

from __future__ import annotations

from dataclasses import dataclass

from k3bundle.executor.taps import layer_of, tap_kind

LAYER_MODES = ("added", "emulation", "router")
ALL = "all"
#: op -> (tap kinds that exercise it, layers: "kda" / "mla" / "moe" / "all", decode path)
OP_EVIDENCE: dict[str, tuple[tuple[str, ...], str, bool]] = {
    "kda_chunked_prefill": (("mixer_out",), "kda", False),
    "kda_recurrent_decode": (("mixer_out",), "kda", True),
    "causal_short_conv1d_with_state": (("mixer_out",), "kda", False),
    "gated_mla_prefill": (("mixer_out",), "mla", False),
    "gated_mla_decode_latent_cache": (("mixer_out",), "mla", True),
    "attn_res_depth_softmax": (("attn_res_out", "ffn_res_out"), ALL, False),
    "situ_glu": (("ffn_out",), ALL, False),
    "sigmoid_biased_topk_router": (("router_ids",), "moe", False),
    "rmsnorm_fp32_stats": (("mixer_out", "ffn_out"), ALL, False),
}
GEMM_EVIDENCE = (("mixer_out", "ffn_out"), ALL, False)  # quantized GEMM ops: every projection feeds these


@dataclass(frozen=True)
class Conformance:
    op: str
    status: str  # "pass" / "fail" / "untested"
    detail: str


def _layer_ok(where: str, layer: int | None, text) -> bool:
    if layer is None:
        return False
    return {"kda": not text.is_mla(layer), "mla": text.is_mla(layer), "moe": text.is_moe(layer), ALL: True}[where]


def kernel_conformance(ops: list[str], signoff: dict | None, text, why: str = "") -> list[Conformance]:
    """The status of each op in ``ops`` from ``signoff`` (the sign-off read, ``reports/validate/RUN_KEY/signoff.json``; None: ``why``)."""
    out = []
    for op in ops:
        rule = OP_EVIDENCE.get(op) or (GEMM_EVIDENCE if op.endswith(("_gemm", "_gemm_grouped")) else None)
        if signoff is None:
            out.append(Conformance(op, "untested", why or "no sign-off"))
            continue
        if rule is None:
            out.append(Conformance(op, "untested", "no check in the sign-off exercises this op"))
            continue
        kinds, where, decode = rule
        checks = [(c["name"], r) for c in signoff.get("cases", []) for r in c.get("results", [])
                  if tap_kind(r.get("tap", "")) in kinds and r.get("tap", "").startswith("decode.") == decode
                  and (decode or r.get("mode") in LAYER_MODES)
                  and _layer_ok(where, layer_of(r.get("tap", "")), text)]
        path = "decode" if decode else "teacher-forced"
        what = f"{path} {' / '.join(kinds)}" + ("" if where == ALL else f" of {where.upper()} layers")
        if not checks:
            out.append(Conformance(op, "untested", f"the sign-off has no {what} check"))
            continue
        bad = [(case, r) for case, r in checks if not r.get("passed")]
        if bad:
            case, r = bad[0]
            out.append(Conformance(op, "fail", f"{len(bad)} of {len(checks)} {what} checks fail; first: {case}, "
                                               f"layer {layer_of(r['tap'])} {r['tap']} ({r.get('mode')})"))
        else:
            out.append(Conformance(op, "pass", f"{len(checks)} {what} checks pass"))
    return out
