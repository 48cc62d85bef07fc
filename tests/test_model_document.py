"""docs/kimi-k3.md, the model document the code cites: every equation number and section cited
in the package and the docs is defined there, its role table is the schema's, and nothing shipped
points at a document outside the repository."""

from __future__ import annotations

import re

from tests._docs import DOCS, block
from tests.conftest import REPO

DOC = DOCS / "kimi-k3.md"
LETTERS = "NEAKMSDRFV"  # norms, embedding, AttnRes, KDA, MLA, SiTU, dense, router/MoE, final, vision
CITED = re.compile(rf"\(([{LETTERS}]\d+)\)")  # "(K5)"
RANGE = re.compile(rf"\b([{LETTERS}])(\d+)\s?[-–]\s?\1?(\d+)\b")  # "K1-K7", "M4–M5", "A1-A2"
SECTION = re.compile(r"kimi-k3\.md`? §(\d+(?:\.\d+)?)(?:\s?[-–]\s?§(\d+(?:\.\d+)?))?")


def _shipped() -> list:
    files = sorted((REPO / "k3bundle").rglob("*.py")) + sorted(DOCS.glob("*.md"))
    return [f for f in files if f != DOC]


def _defined() -> set[str]:
    """Equation numbers the document defines: a paragraph opening with "(K5)"."""
    return set(re.findall(rf"^\(([{LETTERS}]\d+)\)", DOC.read_text(encoding="utf-8"), re.M))


def test_every_cited_equation_is_defined():
    defined = _defined()
    # the model's whole forward pass, as k3bundle runs it, plus the vision tower still to run
    assert {"N1", "E0", "A1", "A2", "S1", "S2", "S3", "D1", "F1"} | {f"K{i}" for i in range(1, 8)} \
        | {f"M{i}" for i in range(1, 6)} | {f"R{i}" for i in range(1, 8)} | {f"V{i}" for i in range(6)} <= defined
    missing, seen = [], set()
    for f in _shipped():
        text = f.read_text(encoding="utf-8")
        cited = set(CITED.findall(text))
        for letter, a, b in RANGE.findall(text):
            if int(a) < int(b) <= 9:
                cited |= {f"{letter}{i}" for i in range(int(a), int(b) + 1)}
        seen |= cited
        # only labels of the model's families count ("(H200)" is a card, not an equation)
        missing += [f"{f.relative_to(REPO)}: ({c})" for c in sorted(cited - defined) if len(c) <= 3]
    assert {"K5", "M4", "R3", "A2", "N1"} <= seen  # the scan sees the citations it checks
    assert not missing, missing


def test_every_cited_section_exists():
    text = DOC.read_text(encoding="utf-8")
    headings = set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", text, re.M))
    missing = [f"{f.relative_to(REPO)}: §{s}" for f in _shipped() for m in SECTION.finditer(f.read_text(encoding="utf-8"))
               for s in m.groups() if s and s not in headings]
    assert not missing, missing


def test_nothing_shipped_cites_a_document_outside_the_repository():
    outside = [str(f.relative_to(REPO)) for f in _shipped()
               if re.search(r"shared/spec|spec/kimi-k3\.md", f.read_text(encoding="utf-8"))]
    assert not outside, outside


def test_the_role_table_is_the_schema():
    from k3bundle.schema.roles import ROLES
    from k3bundle.schema.table import role_table_markdown

    table = block("kimi-k3.md", "roles")
    assert table == role_table_markdown(), "docs/kimi-k3.md's role table differs: run python -m tests._docs"
    assert len(table.strip().splitlines()) == 2 + len(ROLES)
    # one row checked by hand against the release: the routed expert's gate, MXFP4, split by width
    assert ("| `moe.expert.w1` | `{lm}model.layers.{bid}.block_sparse_moe.experts.{eid}.w1` "
            "| [Ie 3,072, Lr 3,584] | MXFP4 (U8 packed + U8 scales) | expert | column (dim 0) (Ie) |") in table
