"""The page style shared by every scaletrain HTML report: a run, a plan, a scaling sweep.

A page is a title, a few lines under it, and sections; a section holds paragraphs, tables, preformatted
text, links and charts. Charts are plotly.js figures (data + layout, the library's own JSON schema) drawn
in the browser by the copy of plotly.js that the pinned `plotly` PyPI package ships: `get_plotlyjs()` is
inlined into the page once, deflate-compressed and base64-encoded (the browser's own `DecompressionStream`
unpacks it), so the file is self-contained and opens with no network access.

Why plotly.js: it is maintained (monthly releases), MIT-licensed, ships inside a PyPI wheel (so pinning the
Python package pins the JavaScript, and nothing is vendored into this repository), and gives hover, zoom,
pan and legend toggling without code of ours. The cost is its size: 4.8 MB of JavaScript (plotly 7.1), 1.96
MB packed as the page carries it (a report of a small run is about 2 MB). Generating a page is string
formatting: the figures are built as plain dicts, not through plotly's Python validators, which are slow on 10k-point
series. See docs/report.md for the numbers.

Every number put into a figure goes through `finite()`: NaN and infinities become JSON null (a gap in
the line), since JSON has no NaN and the browser's parser would reject the page's data.

Pictures a reviewer accepts (tests/test_report.py checks them in chromium): a chart's title is HTML above the
chart, never under plotly's toolbar; sizes (bytes, memory, throughput, time) have axes from zero and byte axes
carry binary units (`byte_unit`); a constant series gets a readable range instead of ticks that differ in the
seventh digit; logarithmic axes label decades (or 2 and 5 within them), so their labels never collide.
"""

from __future__ import annotations

import base64
import functools
import html
import json
import math
import os
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaletrain.errors import UserError, disk_full, disk_full_error

COLOURS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c",
           "#ccb974", "#64b5cd"]


def finite(x: Any) -> float | None:
    """A number for a chart: a finite float, or None (JSON null) for NaN, inf, missing or non-numeric."""
    if type(x) is float:  # the common case, first: x - x is 0.0 exactly when x is finite
        return x if x - x == 0.0 else None
    if isinstance(x, bool):
        return float(x)
    if isinstance(x, (int, float)) and math.isfinite(x):
        return float(x)
    return None


def finite_list(xs: Iterable[Any]) -> list[float | None]:
    return [finite(x) for x in xs]


@dataclass
class Chart:
    """A plotly.js figure: `data` (traces) and `layout`, as plain JSON-able dicts."""

    id: str
    data: list[dict]
    layout: dict
    height: int = 340


@dataclass
class Table:
    header: Sequence[str]
    rows: list[Sequence[Any]]
    id: str = ""


@dataclass
class Text:
    """A paragraph of plain text (escaped)."""

    text: str
    kind: str = "p"  # "p", "note" (muted), "pre" (preformatted), "error"


@dataclass
class Link:
    href: str
    label: str


@dataclass
class Section:
    id: str
    title: str
    blocks: list[Chart | Table | Text | Link | list] = field(default_factory=list)

    def add(self, *blocks: Chart | Table | Text | Link | list) -> Section:
        self.blocks.extend(blocks)
        return self

    def charts(self) -> list[Chart]:
        out = []
        for b in self.blocks:
            if isinstance(b, Chart):
                out.append(b)
            elif isinstance(b, list):
                out += [x for x in b if isinstance(x, Chart)]
        return out


@dataclass
class Page:
    title: str
    subtitle: str
    sections: list[Section]
    generated_by: str = "scaletrain"

    def charts(self) -> list[Chart]:
        return [c for s in self.sections for c in s.charts()]


# --------------------------------------------------------------------------- chart helpers


def axis(title: str, log: bool = False, **extra: Any) -> dict:
    out = {"title": {"text": title}, "automargin": True, "zeroline": False}
    if log:
        out["type"] = "log"
    out.update(extra)
    return out


BYTE_UNITS = ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"), (1, "bytes"))


def byte_unit(largest: float | None) -> tuple[float, str]:
    """(divisor, unit) for an axis of byte counts whose largest value is `largest`: the largest binary unit the
    value reaches, so ticks read 1.5 GiB, never plotly's SI "1.5G" (giga, not gibi) or "500B" (billion)."""
    for div, unit in BYTE_UNITS:
        if largest is not None and largest >= div:
            return float(div), unit
    return 1.0, "bytes"


def in_unit(values: Sequence[Any], div: float) -> list[float | None]:
    return [None if finite(v) is None else finite(v) / div for v in values]


def y_values(traces: list[dict], axis_key: str) -> list[float]:
    out: list[float] = []
    for t in traces:
        if t.get("yaxis", "y") == axis_key:
            out += [v for v in t.get("y", []) if isinstance(v, (int, float)) and finite(v) is not None]
    return out


def fit_axis(ax: dict, values: list[float], log: bool = False, zero: bool = False) -> dict:
    """Readable ticks for one axis from the values it shows: from zero for sizes (`zero`); a constant series gets
    a range of +-10% around it (plotly would zoom to +-1 unit of its last digit); a logarithmic axis labels
    every decade when it spans three or more, 2 and 5 within decades when it spans one or more."""
    pos = [v for v in values if v > 0]
    if log and pos:
        span = math.log10(max(pos)) - math.log10(min(pos))
        if span >= 3:
            ax["dtick"] = 1
        elif span >= 1:
            ax["dtick"] = "D2"
        return ax
    if zero:
        ax["rangemode"] = "tozero"
    if values and max(values) - min(values) <= 1e-9 * max(abs(max(values)), abs(min(values)), 1e-300):
        v = values[0]
        pad = abs(v) * 0.1 or 1.0
        ax["range"] = [0.0 if zero and v >= 0 else v - pad, v + pad]
    return ax


def line_chart(id: str, title: str, x_title: str, y_title: str, traces: list[dict], log_y: bool = False,
               height: int = 340, zero: bool = False, y_format: str = "", **layout: Any) -> Chart:
    """Lines over a shared x axis; traces are plotly scatter traces (x, y, name, ...). `zero`: the y axis starts
    at zero (the quantity is a size); `y_format`: a d3 format for the y ticks and hover (",.0f" for rates)."""
    for i, t in enumerate(traces):
        t.setdefault("type", "scatter")
        t.setdefault("mode", "lines")
        if "line" not in t and "marker" not in t:
            t["line"] = {"width": 1.5, "color": COLOURS[i % len(COLOURS)]}
    y = fit_axis(axis(y_title, log_y), y_values(traces, "y"), log_y, zero)
    if y_format:
        y.update(tickformat=y_format, hoverformat=y_format)
    lay = {"title": {"text": title}, "xaxis": axis(x_title), "yaxis": y,
           "hovermode": "x unified", "legend": {"orientation": "h", "y": -0.25}, "margin": {"t": 40}}
    lay.update(layout)
    return Chart(id, traces, lay, height)


def series(x: Sequence[Any], y: Sequence[Any], name: str, **extra: Any) -> dict:
    return {"x": finite_list(x), "y": finite_list(y), "name": name, **extra}


# --------------------------------------------------------------------------- rendering

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#1f2d3d;color:#fff;padding:14px 24px}
header h1{margin:0;font-size:20px}header p{margin:4px 0 0;color:#cfd8e3;font-size:13px}
nav{padding:8px 24px;background:#eef1f5;font-size:13px;position:sticky;top:0;z-index:10}
nav a{margin-right:14px;color:#1f4e79;text-decoration:none}
main{padding:8px 24px 40px;max-width:1500px}
section{background:#fff;border:1px solid #e1e4e8;border-radius:6px;margin:16px 0;padding:8px 16px 14px}
section h2{font-size:17px;margin:8px 0}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(520px,1fr));gap:8px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
td,th{border:1px solid #e1e4e8;padding:3px 8px;text-align:right;vertical-align:top}
th{background:#f3f5f7}td:first-child,th:first-child{text-align:left}
pre{background:#f6f8fa;padding:8px;font-size:12px;overflow:auto;max-height:420px}
.note{color:#666;font-size:13px}.error{color:#b00020;font-size:13px}
footer{color:#888;font-size:12px;padding:0 24px 20px}
.chart-box h3{font-size:14px;font-weight:600;margin:6px 0 0 4px;color:#333}
"""

_BOOT = """
(async function(){
  try {
    var packed = atob(document.getElementById('st-plotly').textContent);
    var bytes = new Uint8Array(packed.length);
    for (var i = 0; i < packed.length; i++) bytes[i] = packed.charCodeAt(i);
    var stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream('deflate'));
    var code = document.createElement('script');
    code.textContent = await new Response(stream).text();
    document.head.appendChild(code);
  } catch (e) {
    document.body.setAttribute('data-charts-error', String(e));
    document.querySelectorAll('.chart').forEach(function(c){
      c.textContent = 'This browser cannot unpack the charts (DecompressionStream: Chrome 80, Firefox 113, ' +
                      'Safari 16.4 or newer): ' + e;
    });
    return;
  }
  var figs = JSON.parse(document.getElementById('st-figures').textContent);
  figs.forEach(function(f){
    var layout = Object.assign({autosize:true,height:f.height,font:{size:12}}, f.layout);
    layout.title = {text: ''};  /* drawn as HTML above the chart, clear of the toolbar */
    layout.margin = Object.assign({}, layout.margin, {t: 28});
    Plotly.newPlot(f.id, f.data, layout, {responsive:true, displaylogo:false,
      modeBarButtonsToRemove:['select2d','lasso2d','autoScale2d','toggleSpikelines','hoverClosestCartesian',
                              'hoverCompareCartesian']});
  });
  document.body.setAttribute('data-charts-drawn', String(figs.length));
})();
"""


def _cell(x: Any) -> str:
    if isinstance(x, Link):
        return f'<a href="{html.escape(x.href, quote=True)}">{html.escape(x.label)}</a>'
    if isinstance(x, float):
        return html.escape(fmt(x))
    return html.escape(str(x))


def fmt(x: float) -> str:
    """A number as the page prints it in tables."""
    if not math.isfinite(x):
        return str(x)
    if x != 0 and (abs(x) >= 1e6 or abs(x) < 1e-3):
        return f"{x:.4g}"
    return f"{x:,.4f}".rstrip("0").rstrip(".") if abs(x) < 1000 else f"{x:,.1f}"


def _block(b: Chart | Table | Text | Link | list) -> str:
    if isinstance(b, list):
        return '<div class="grid">' + "".join(_block(x) for x in b) + "</div>"
    if isinstance(b, Chart):
        title = html.escape(str((b.layout.get("title") or {}).get("text", ""))).replace("&lt;br&gt;", "<br>")
        return (f'<div class="chart-box"><h3 class="chart-title">{title}</h3><div class="chart" '
                f'id="{html.escape(b.id, quote=True)}" style="min-height:{b.height}px"></div></div>')
    if isinstance(b, Table):
        head = "".join(f"<th>{html.escape(str(h))}</th>" for h in b.header)
        body = "".join("<tr>" + "".join(f"<td>{_cell(c)}</td>" for c in row) + "</tr>" for row in b.rows)
        tid = f' id="{html.escape(b.id, quote=True)}"' if b.id else ""
        return f"<table{tid}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    if isinstance(b, Link):
        return f"<p>{_cell(b)}</p>"
    if b.kind == "pre":
        return f"<pre>{html.escape(b.text)}</pre>"
    cls = f' class="{b.kind}"' if b.kind in ("note", "error") else ""
    return f"<p{cls}>{html.escape(b.text)}</p>"


def _script_json(obj: Any) -> str:
    """JSON for a <script type="application/json"> element: strict (no NaN) and unable to close the tag."""
    # "<" appears only inside JSON strings, where \u003c is the same character to the parser
    return json.dumps(obj, allow_nan=False, separators=(",", ":")).replace("<", "\\u003c")


@functools.lru_cache(maxsize=1)
def plotly_js() -> str:
    """The plotly.js bundle of the installed `plotly` package (inlined into every page)."""
    try:
        from plotly.offline import get_plotlyjs
    except ImportError as e:
        raise UserError(f"HTML reports need the plotly package ({e}); pip install 'plotly>=6,<8'") from None
    return get_plotlyjs()


@functools.lru_cache(maxsize=1)
def plotly_js_packed() -> str:
    """The bundle as the page carries it: deflate (zlib format, level 9) then base64, 0.41x its size."""
    return base64.b64encode(zlib.compress(plotly_js().encode(), 9)).decode("ascii")


def render(page: Page) -> str:
    """The page as one self-contained HTML document."""
    charts = page.charts()
    ids = [c.id for c in charts]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate chart ids in the page: {sorted(i for i in set(ids) if ids.count(i) > 1)}")
    nav = "".join(f'<a href="#{html.escape(s.id, quote=True)}">{html.escape(s.title)}</a>' for s in page.sections)
    parts = [f'<section id="{html.escape(s.id, quote=True)}"><h2>{html.escape(s.title)}</h2>'
             + "".join(_block(b) for b in s.blocks) + "</section>" for s in page.sections]
    figures = [{"id": c.id, "data": c.data, "layout": c.layout, "height": c.height} for c in charts]
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<meta name=\"generator\" content=\"{html.escape(page.generated_by, quote=True)}\">"
        f"<title>{html.escape(page.title)}</title><style>{_CSS}</style>"
        "</head><body>"
        f"<header><h1>{html.escape(page.title)}</h1><p>{html.escape(page.subtitle)}</p></header>"
        f"<nav>{nav}</nav><main>{''.join(parts)}</main>"
        f"<footer>written by {html.escape(page.generated_by)} at {html.escape(stamp)}</footer>"
        f'<script type="application/json" id="st-figures">{_script_json(figures)}</script>'
        f'<script type="application/octet-stream" id="st-plotly">{plotly_js_packed()}</script>'
        f"<script>{_BOOT}</script></body></html>\n"
    )


def write(page: Page, path: str | os.PathLike) -> Path:
    """Render and write atomically (a temporary file renamed into place): a failure leaves any previous
    page as it was."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path} is a directory; give the name of the HTML file to write")
    text = render(page)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        if not disk_full(e):
            raise
        kept = "the earlier page is intact" if path.exists() else "nothing was written"
        raise disk_full_error("the page", path, f"; {kept}") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def figures_of(html_text: str) -> dict[str, dict]:
    """The figures embedded in a page, by chart id (what the browser will draw): for tests and tools."""
    start = html_text.index('<script type="application/json" id="st-figures">')
    start = html_text.index(">", start) + 1
    end = html_text.index("</script>", start)
    return {f["id"]: f for f in json.loads(html_text[start:end])}
