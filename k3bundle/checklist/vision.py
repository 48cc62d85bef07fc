"""The MoonViT tower and projector per image: its shapes at a stated image size, FLOPs, bytes, bound.

The image is ``IMAGE_SIDE`` × ``IMAGE_SIDE`` pixels; its patch grid comes from the released
processor's size rule (``k3bundle.media.plan_resize``, docs/kimi-k3.md §3.9 V0): 1,024 × 1,024 is
padded to 1,036 × 1,036, a 74 × 74 grid of N = 5,476 patches and N / 4 = 1,369 merged tokens.
The tower is replicated on stage 0, never split, so one card encodes one image:

    t_image ≥ max( weight bytes / HBM bandwidth, FLOPs / peak_bf16 )

FLOPs (a GEMM is 2·out·in per row it multiplies; Q = heads × dh = ``qkv_hidden_size``):
  patch embedding          N · 2·Dv·3·P²                      (V1, a matrix product per patch)
  attention projections    blocks · N · 2·(3Q·Dv + Dv·Q)      (V2: W_qkv, W_o)
  attention core           blocks · 4·N²·Q                    (V2: q kᵀ and p v, non-causal over the image)
  MLP                      blocks · N · 2·(Iv·Dv + Dv·Iv)     (V2: fc0, fc1)
  projector                (N/m) · 2·(Dm·Dm + D·Dm)           (V5: m = 2×2 merge, Dm = m·Dv)
Bytes: each row's weights as the plan stores them (BF16: layouts keep the tower as released), read
once per image. Activations, norms, RoPE, the position table's resize and the merge are left out,
as in the text roofline (roofline.py): every term left out only adds time.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3bundle.checklist.quantity import Quantity, flops, gb
from k3bundle.checklist.roofline import peak
from k3bundle.media.geometry import MERGE, PATCH, plan_resize
from k3bundle.plan import Plan, storage_name
from k3bundle.storage import STORAGE

IMAGE_SIDE = 1024  # the stated image: 1,024 × 1,024 pixels (a common photo size, under every limit of V0)

# (row key, label, the roles whose stored weights it reads)
ROWS = (
    ("patch_embed", "patch embedding", ("vit.patch_embed",)),
    ("attn_proj", "attention projections (W_qkv, W_o)", ("vit.wqkv", "vit.wo")),
    ("attn_core", "attention core (q kᵀ, p v)", ()),
    ("mlp", "MLP (fc0, fc1)", ("vit.fc0", "vit.fc1")),
    ("projector", "projector (W_p1, W_p2)", ("proj.fc1", "proj.fc2")),
)


@dataclass(frozen=True)
class VisionShapes:
    """One image through the tower: the grid the size rule gives and the config's widths."""

    width: int  # the image as given, pixels
    height: int
    padded: tuple[int, int]  # (width, height) after the resize and the padding to 28
    grid: tuple[int, int]  # patch rows, patch columns
    patches: int  # N
    tokens: int  # N / m, merged tokens = <|media_pad|> positions
    hidden: int  # Dv
    heads: int
    head_dim: int  # dh
    mlp: int  # Iv
    blocks: int
    merged: int  # Dm = m · Dv, the projector's input width
    text: int  # D, the projector's output width
    patch: int  # P
    merge: int  # m

    @property
    def qkv(self) -> int:
        return self.heads * self.head_dim


def vision_shapes(plan: Plan, width: int = IMAGE_SIDE, height: int = IMAGE_SIDE) -> VisionShapes | None:
    """The shapes of one ``width`` × ``height`` image, or None for a model without a vision tower or
    one whose patch or merge size is not the processor's (its grid would not be the size rule's)."""
    v = plan.config.vision
    if v is None or v.patch_size != PATCH or tuple(v.merge_kernel_size) != (MERGE, MERGE):
        return None
    r = plan_resize(width, height)
    _, rows, cols = r.grid_thw
    m = MERGE * MERGE
    return VisionShapes(width, height, (r.padded_width, r.padded_height), (rows, cols), r.num_patches,
                        r.num_tokens, v.vt_hidden_size, v.vt_num_attention_heads,
                        v.qkv_hidden_size // v.vt_num_attention_heads, v.vt_intermediate_size,
                        v.vt_num_hidden_layers, m * v.mm_hidden_size, v.text_hidden_size, v.patch_size, m)


def row_flops(s: VisionShapes) -> dict[str, float]:
    """FLOPs of one image by row (module docstring)."""
    N, Dv, Q, Iv, L = s.patches, s.hidden, s.qkv, s.mlp, s.blocks
    return {
        "patch_embed": N * 2.0 * Dv * 3 * s.patch ** 2,
        "attn_proj": L * N * 2.0 * (3 * Q * Dv + Dv * Q),
        "attn_core": L * 4.0 * N * N * Q,
        "mlp": L * N * 2.0 * (Iv * Dv + Dv * Iv),
        "projector": s.tokens * 2.0 * (s.merged * s.merged + s.text * s.merged),
    }


def _formulas(s: VisionShapes) -> dict[str, str]:
    N, Dv, Q, Iv, L = s.patches, s.hidden, s.qkv, s.mlp, s.blocks
    return {
        "patch_embed": f"N · 2·Dv·3·P² = {N:,} × 2·{Dv}·3·{s.patch}²",
        "attn_proj": f"blocks · N · 2·(3Q·Dv + Dv·Q) = {L} × {N:,} × 2·(3·{Q}·{Dv} + {Dv}·{Q})",
        "attn_core": f"blocks · 4·N²·Q = {L} × 4 × {N:,}² × {Q} (Q = {s.heads} heads × {s.head_dim}; non-causal)",
        "mlp": f"blocks · N · 2·(Iv·Dv + Dv·Iv) = {L} × {N:,} × 2·({Iv}·{Dv} + {Dv}·{Iv})",
        "projector": (f"(N/m) · 2·(Dm·Dm + D·Dm) = {s.tokens:,} × 2·({s.merged}·{s.merged} + "
                      f"{s.text}·{s.merged})"),
    }


def describe(s: VisionShapes) -> str:
    """The shapes in one line: the image, its grid, the tower's widths and the projector's."""
    return (f"per image at {s.width:,}×{s.height:,} px (padded {s.padded[0]:,}×{s.padded[1]:,}): N = {s.grid[0]}×"
            f"{s.grid[1]} = {s.patches:,} patches; q, k, v [{s.patches:,}, {s.heads}, {s.head_dim}] with 2-D RoPE, "
            f"non-causal within the image; hidden {s.hidden:,}, MLP {s.mlp:,}, {s.blocks} blocks; projector "
            f"[{s.tokens:,}, {s.merged:,}] → {s.merged:,} → {s.text:,}")


@dataclass
class VisionRoofline:
    """The per-image bound of the tower and projector on one card, every number with its formula."""

    shapes: VisionShapes
    bytes: list[Quantity]
    flops: list[Quantity]
    t_memory: Quantity
    t_compute: Quantity
    bound: Quantity

    @property
    def quantities(self) -> list[Quantity]:
        return [*self.bytes, *self.flops, self.t_memory, self.t_compute, self.bound]

    def to_dict(self) -> dict:
        s = self.shapes
        return {"image": [s.width, s.height], "padded": list(s.padded), "grid": list(s.grid),
                "patches": s.patches, "tokens": s.tokens, "bound_s": self.bound.value,
                "quantities": [q.to_dict() for q in self.quantities]}


def vision_roofline(plan: Plan, width: int = IMAGE_SIDE, height: int = IMAGE_SIDE) -> VisionRoofline | None:
    """The bound of one image on one card of stage 0; None where ``vision_shapes`` is None."""
    s = vision_shapes(plan, width, height)
    if s is None:
        return None
    card = plan.layout.card
    held: dict[str, int] = {}  # role -> stored bytes of all its instances on rank 0 (stage 0 holds them whole)
    bucket = "bf16"
    for t in plan.targets:
        if t.rank == 0 and t.role.role in {r for _, _, roles in ROWS for r in roles}:
            held[t.role.role] = held.get(t.role.role, 0) + plan.target_bytes(t)
            bucket = STORAGE[storage_name(t.rule, t.role)].peak_bucket
    key, flop_s = peak(card.peak_flops, bucket)
    fl = row_flops(s)
    formulas = _formulas(s)
    byte_q = [Quantity(f"vision_bytes_{row}", f"{label} weights", sum(held.get(r, 0) for r in roles), "B",
                       " + ".join(f"{r} {gb(held.get(r, 0))}" for r in roles) + " (stored, rank 0)")
              for row, label, roles in ROWS if roles]
    total_bytes = sum(q.value for q in byte_q)
    byte_q.append(Quantity("vision_bytes_total", "bytes per image", total_bytes, "B",
                           "the weights above, read once per image; activations left out"))
    flop_q = [Quantity(f"vision_flops_{row}", f"{label} [{key}]", fl[row], "FLOP", formulas[row])
              for row, label, _ in ROWS]
    total_flops = sum(fl.values())
    flop_q.append(Quantity("vision_flops_total", "FLOPs per image", total_flops, "FLOP", "sum of the rows above"))
    bw = float(card.hbm_bandwidth_bytes_per_s)
    tm = total_bytes / bw
    tc = total_flops / flop_s
    return VisionRoofline(
        s, byte_q, flop_q,
        Quantity("vision_t_memory", "memory time", tm, "s", f"bytes / HBM bandwidth = {total_bytes:,} / {bw:,.0f} B/s"),
        Quantity("vision_t_compute", "compute time", tc, "s",
                 f"FLOPs / peak = {flops(total_flops)} / ({key} {flop_s:,.0f} FLOP/s), one card"),
        Quantity("vision_bound", "time to encode one image ≥", max(tm, tc), "s", "max(t_memory, t_compute)"))


__all__ = ["IMAGE_SIDE", "VisionRoofline", "VisionShapes", "describe", "row_flops", "vision_roofline", "vision_shapes"]
