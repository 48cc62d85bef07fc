"""The page shell every report shares: typography, colours, tables, badges, a print stylesheet.

Colours are the Okabe-Ito palette (distinguishable under the common colour-vision deficiencies);
every colour meaning is also carried by a word, a marker shape or a dash pattern.
"""

from __future__ import annotations

import html
from collections.abc import Iterable

#: One meaning per colour, on every page.
COLOURS = {
    "added": "#0072B2",  # blue: error a layer adds (teacher-forced)
    "inherited": "#E69F00",  # orange: error carried from earlier layers (free-running)
    "emulation": "#CC79A7",  # reddish purple: a dump's own arithmetic
    "router": "#009E73",  # bluish green: expert-set agreement
    "kld": "#56B4E9",  # sky blue: KL divergence
    "fail": "#D55E00",  # vermillion: failures, limits exceeded
    "pass": "#009E73",
    "limit": "#444444",
    "weights": "#0072B2",
    "cache": "#E69F00",
    "reserve": "#999999",
    "free": "#DDEEDD",
}

CSS = """
:root{--ink:#1d232a;--muted:#5b6570;--rule:#d8dde3;--bg:#f6f8fa;--pass:#00704f;--fail:#b34700;--warn:#8a6d00}
*{box-sizing:border-box}
body{font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;color:var(--ink);
 max-width:1180px;margin:0 auto;padding:28px 32px 64px;background:#fff}
h1{font-size:26px;margin:0 0 4px}h2{font-size:20px;margin:36px 0 8px;padding-top:12px;border-top:1px solid var(--rule)}
h3{font-size:16px;margin:20px 0 6px}
.sub{color:var(--muted);margin:0 0 18px}
code,.mono{font:13px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
table{border-collapse:collapse;width:100%;margin:8px 0 14px;font-size:14px}
th,td{padding:6px 10px;border-bottom:1px solid var(--rule);text-align:left;vertical-align:top}
th{background:var(--bg);font-weight:600;white-space:nowrap}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tr.bad td{background:#fff4ec}
table.sortable th{cursor:pointer}table.sortable th:after{content:" \\2195";color:#aab}
.badge{display:inline-block;white-space:nowrap;padding:1px 9px;border-radius:10px;font-weight:600;font-size:13px;letter-spacing:.02em}
.badge.pass{background:#dff3ea;color:var(--pass)}.badge.fail{background:#fde6d8;color:var(--fail)}
.badge.notrun,.badge.open{background:#eceff2;color:var(--muted)}
.verdict{display:inline-block;font-size:22px;padding:2px 14px;border-radius:8px;margin-right:10px}
.verdict.pass{background:#dff3ea;color:var(--pass)}.verdict.fail{background:#fde6d8;color:var(--fail)}
dl.meta{display:grid;grid-template-columns:max-content 1fr;gap:2px 18px;margin:10px 0 18px;font-size:14px}
dl.meta dt{color:var(--muted)}dl.meta dd{margin:0}
.callout{border-left:4px solid var(--fail);background:#fff4ec;padding:10px 14px;margin:10px 0;border-radius:0 6px 6px 0}
.callout.ok{border-color:var(--pass);background:#eef8f3}
figure{margin:14px 0 6px;break-inside:avoid}figcaption{color:var(--muted);font-size:13px;margin-top:2px}
svg{max-width:100%;height:auto;display:block}
details{margin:8px 0 16px}summary{cursor:pointer;font-weight:600;color:#0b5394}
.muted{color:var(--muted)}
a{color:#0b5394}
@media print{
 body{max-width:none;padding:0;font-size:11pt}
 h2{break-before:auto;break-after:avoid}
 figure,table,tr{break-inside:avoid}
 a{color:inherit;text-decoration:none}
 summary{display:none}
 .noprint{display:none}
 .badge,.verdict,tr.bad td,.callout,th{-webkit-print-color-adjust:exact;print-color-adjust:exact}
}
"""

# Sorting by a header click, and every <details> opened for printing: the page reads the same
# without it.
SCRIPT = """
document.querySelectorAll('table.sortable').forEach(function(t){
 t.querySelectorAll('th').forEach(function(th,i){th.addEventListener('click',function(){
  var b=t.tBodies[0],rows=Array.from(b.rows),asc=th.dataset.dir!=='asc';th.dataset.dir=asc?'asc':'desc';
  var key=function(r){var c=r.cells[i];var v=c.dataset.sort!==undefined?c.dataset.sort:c.textContent;
   var n=parseFloat(v);return isNaN(n)?v.toLowerCase():n};
  rows.sort(function(x,y){var a=key(x),c=key(y);return (a<c?-1:a>c?1:0)*(asc?1:-1)});
  rows.forEach(function(r){b.appendChild(r)});});});});
window.addEventListener('beforeprint',function(){document.querySelectorAll('details').forEach(function(d){d.open=true})});
"""


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def page(title: str, body: str) -> str:
    """A whole self-contained document."""
    return (f"<!doctype html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<meta name='viewport' content='width=device-width,initial-scale=1'><title>{esc(title)}</title>"
            f"<style>{CSS}</style></head><body>\n{body}\n<script>{SCRIPT}</script></body></html>\n")


def badge(status: str) -> str:
    """``pass`` / ``fail`` / ``not run`` / ``open`` as a coloured word."""
    cls = {"pass": "pass", "fail": "fail", "done": "pass"}.get(status, "notrun")
    return f"<span class='badge {cls}'>{esc(status.upper())}</span>"


def table(headers: Iterable[str], rows: Iterable[Iterable[str]], cls: str = "", num: Iterable[int] = (),
          row_cls: Iterable[str] | None = None) -> str:
    """A table of already-escaped cells; columns in ``num`` align right."""
    num = set(num)
    head = "".join(f"<th{' class=num' if i in num else ''}>{h}</th>" for i, h in enumerate(headers))
    body = []
    classes = list(row_cls) if row_cls is not None else None
    for k, row in enumerate(rows):
        rc = f" class='{classes[k]}'" if classes and classes[k] else ""
        body.append(f"<tr{rc}>" + "".join(f"<td{' class=num' if i in num else ''}>{c}</td>"
                                          for i, c in enumerate(row)) + "</tr>")
    return (f"<table{f' class={cls!r}' if cls else ''}><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>")


def meta(items: Iterable[tuple[str, str]]) -> str:
    """A definition list of (label, escaped value)."""
    return "<dl class='meta'>" + "".join(f"<dt>{esc(k)}</dt><dd>{v}</dd>" for k, v in items) + "</dl>"


def sci(v: float | None) -> str:
    """A metric value for people: scientific below 1e-2, else 4 significant digits."""
    if v is None:
        return "–"
    if isinstance(v, str):
        return v
    if v != v or v in (float("inf"), float("-inf")):
        return str(v)
    if v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e5):
        return f"{v:.2e}"
    return f"{v:.4g}"
