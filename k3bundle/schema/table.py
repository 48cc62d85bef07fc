"""The role table as the model document shows it (docs/kimi-k3.md §2, a generated block).

One row per role of ``roles.ROLES`` at the released config: the name template, the logical
shape with its dimension names resolved, the stored format, where the role occurs and how
tensor parallelism splits it. Rendered from the table itself, so the document cannot drift.
"""

from __future__ import annotations

from k3bundle.config import load_config, release_config_path
from k3bundle.schema.roles import ROLES, TP, Format, Role, dimensions

_FORMAT = {Format.BF16: "BF16", Format.F32: "F32", Format.MXFP4: "MXFP4 (U8 packed + U8 scales)"}
_TP = {TP.REPLICATE: "replicated", TP.COLUMN: "column (dim 0)", TP.ROW: "row (dim 1)", TP.VOCAB: "vocab rows"}


def _shape(role: Role, dims: dict[str, int]) -> str:
    return "[" + ", ".join(f"{dims[d]:,}" if d in ("1", "3") else f"{d} {dims[d]:,}" for d in role.shape) + "]"


def role_table_markdown() -> str:
    """The role table at the released config, as a markdown table."""
    cfg = load_config(release_config_path())
    dims = dimensions(cfg.text, cfg.vision)
    rows = ["| role | checkpoint name | logical shape | stored as | occurs | TP split (unit) |",
            "|---|---|---|---|---|---|"]
    for r in ROLES:
        unit = f" ({r.unit})" if r.unit and r.tp is not TP.REPLICATE else ""
        rows.append(f"| `{r.role}` | `{r.template}` | {_shape(r, dims)} | {_FORMAT[r.fmt]} | {r.scope.value} "
                    f"| {_TP[r.tp]}{unit} |")
    return "\n".join(rows) + "\n"
