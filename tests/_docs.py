"""Generated blocks of docs/: each lies between ``<!-- BEGIN KEY (generated) -->`` and
``<!-- END KEY -->`` and is rendered from the code it documents, so a page cannot drift from it.
Tests compare each block with its renderer; ``python -m tests._docs`` rewrites them all."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _pattern(key: str) -> re.Pattern:
    return re.compile(rf"(<!-- BEGIN {re.escape(key)} \(generated\) -->\n)(.*?)(<!-- END {re.escape(key)} -->)", re.S)


def block(page: str, key: str) -> str:
    """The generated block ``key`` of ``docs/PAGE`` as it stands."""
    m = _pattern(key).search((DOCS / page).read_text(encoding="utf-8"))
    assert m is not None, f"docs/{page} has no generated block {key!r}"
    return m.group(2)


def fill(page: str, key: str, body: str) -> None:
    path = DOCS / page
    text = path.read_text(encoding="utf-8")
    assert _pattern(key).search(text), f"docs/{page} has no generated block {key!r}"
    path.write_text(_pattern(key).sub(lambda m: m.group(1) + body + m.group(3), text), encoding="utf-8")


def blocks() -> dict[tuple[str, str], Callable[[], str]]:
    """(page, key) -> its renderer."""
    from k3bundle.executor.taps import tap_table_markdown
    from k3bundle.ops.contract import contracts_markdown
    from k3bundle.schema.table import role_table_markdown

    return {("dump-format.md", "taps"): tap_table_markdown, ("kernels.md", "contracts"): contracts_markdown,
            ("kimi-k3.md", "roles"): role_table_markdown}


if __name__ == "__main__":
    for (page, key), render in blocks().items():
        fill(page, key, render())
        print(f"docs/{page}: {key}")
