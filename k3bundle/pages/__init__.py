"""Self-contained HTML pages: the page shell and table helpers (``html``) and SVG charts (``svg``).

Shared by the sign-off report and the checklist; no network, no dependency, readable without
JavaScript, printable.
"""
