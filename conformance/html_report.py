"""An HTML report with plots (matplotlib, embedded): error against context length per
backend and dtype, and benchmark rates against the copy-bandwidth ceiling.

Rendered from saved JSON (a run's report, optionally a bench run's results), so a CI job can
draw it after the fact: ``python -m conformance html --report-json r.json --out r.html``.
"""

from __future__ import annotations

import base64
import html
import io
import re
from pathlib import Path

from conformance.dtypes import SHORT_NAMES
from conformance.report import worst_errors
from conformance.status import FAILING

_CTX = re.compile(r"ctx\[([\d,]+)\]|ctx(\d+)x\[(\d+)\.\.(\d+)\]|ctx(\d+)x\[(\d+)\]")
DTYPE_COLOURS = {"f32": "tab:blue", "f16": "tab:orange", "bf16": "tab:green"}


def longest_context(row: dict) -> int:
    """The row's longest context (reports before 2026-11-30 hold it only in the case id)."""
    if row.get("context") is not None and "dtype" in row:
        return int(row["context"])
    match = _CTX.search(row["case"])
    if not match:
        return 0
    if match.group(1):
        return max(int(n) for n in match.group(1).split(","))
    return int(match.group(4) or match.group(6) or 0)


def case_dtype(row: dict) -> str:
    """The short dtype name of the row's case (older reports: parsed from the id)."""
    if row.get("dtype"):
        return SHORT_NAMES[row["dtype"]]
    shape = row["case"].split("/ctx")[0].rsplit("/", 1)[-1]
    return shape.rsplit("-", 1)[-1]


def _png(figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode()


def error_figure(report: dict) -> str | None:
    """Oracle output error against the longest context of the case, a panel per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if r["check"] == "oracle/output"
            and isinstance(r.get("error"), (int, float)) and r["error"] is not None]
    backends = sorted({r["backend"] for r in rows})
    if not backends:
        return None
    figure, axes = plt.subplots(1, len(backends), figsize=(5 * len(backends), 3.6),
                                squeeze=False)
    for axis, backend in zip(axes[0], backends, strict=True):
        for dtype, colour in DTYPE_COLOURS.items():
            mine = [r for r in rows if r["backend"] == backend and case_dtype(r) == dtype]
            if mine:
                axis.scatter([max(1, longest_context(r)) for r in mine],
                             [max(r["error"], 1e-12) for r in mine], s=12, c=colour,
                             label=dtype, alpha=0.7)
                budgets = {r["budget_table"] for r in mine if r.get("budget_table")}
                for budget in budgets:
                    axis.axhline(budget, color=colour, linestyle="--", linewidth=0.8)
        axis.set(xscale="log", yscale="log", title=backend, xlabel="longest context (tokens)",
                 ylabel="output error (relative)")
        axis.legend(fontsize=8)
    return _png(figure)


def bench_figure(bench: dict) -> str | None:
    """Achieved bytes/s per shape and backend, with the copy rate as the ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = bench.get("results", [])
    if not results:
        return None
    shapes = list(dict.fromkeys(r["shape"] for r in results))
    backends = list(dict.fromkeys(r["backend"] for r in results))
    figure, axis = plt.subplots(figsize=(max(6, 1.4 * len(shapes)), 3.6))
    width = 0.8 / len(backends)
    for i, backend in enumerate(backends):
        rates = {r["shape"]: r["bytes_per_s"] / 1e9 for r in results if r["backend"] == backend}
        axis.bar([j + i * width for j in range(len(shapes))],
                 [rates.get(s, 0) for s in shapes], width, label=backend)
    if bench.get("copy_bytes_per_s"):
        axis.axhline(bench["copy_bytes_per_s"] / 1e9, color="black", linestyle="--",
                     label="device-to-device copy (read + write)")
    axis.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes, rotation=30,
                    ha="right", fontsize=8)
    axis.set(ylabel="GB/s (K and V read once)", title="benchmarks")
    axis.legend(fontsize=8)
    return _png(figure)


def ran_where(report: dict) -> str:
    """The machine, its libraries, each backend's description and device, and the command."""
    machine = report.get("machine") or {}
    libraries = ", ".join(f"{name} {version}" for name, version in
                          (machine.get("libraries") or {}).items())
    rows = "".join(
        f"<tr><td>{html.escape(str(b.get('name', '')))}</td>"
        f"<td>{html.escape(str(b.get('device', '')))}</td>"
        f"<td>{html.escape(str(b.get('description', '')))}"
        f"{''.join('<br>' + html.escape(str(n)) for n in b.get('notes', []) or [])}</td></tr>"
        for b in report.get("backends", []))
    command = report.get("command")
    command = " ".join(command) if isinstance(command, list) else str(command or "")
    return (f"<h2>What ran where</h2><p>{html.escape(str(machine.get('platform', '')))}, "
            f"python {html.escape(str(machine.get('python', '')))}; "
            f"{html.escape(libraries)}</p><p><code>{html.escape(command)}</code></p>"
            f"<table><tr><th>backend</th><th>device</th><th>what it is</th></tr>{rows}</table>")


def render(report: dict, bench: dict | None = None) -> str:
    summary = report.get("summary", {})
    families = sorted({f for counts in summary.values() for f in counts})
    head = "".join(f"<th>{html.escape(f)}</th>" for f in families)
    body = ""
    for backend, counts in summary.items():
        cells = "".join(
            "<td>" + html.escape(", ".join(f"{k} {v}" for k, v in counts.get(f, {}).items()))
            + "</td>" for f in families)
        body += f"<tr><th>{html.escape(backend)}</th>{cells}</tr>"
    failures = [r for r in report["results"]
                if r["status"] in FAILING][:100]
    failure_items = "".join(
        f"<li><b>{html.escape(r['status'])}</b> {html.escape(r['backend'])} "
        f"<code>{html.escape(r['check'])}</code> on <code>{html.escape(r['case'])}</code>: "
        f"{html.escape(r['message'])}<br><code>{html.escape(r['reproducer'])}</code></li>"
        for r in failures)
    known = report.get("known_failures", [])
    known_rows = "".join(
        f"<tr><td>{html.escape(g['backend'])}</td><td>{g['count']}</td>"
        f"<td><code>{html.escape(g['check'])}</code></td>"
        f"<td><code>{html.escape(g['case'] or g['example'])}</code></td>"
        f"<td>{html.escape(g['reason'])}</td><td>{html.escape(g['link'])}</td></tr>"
        for g in known)
    known_table = (f"<h2>Known failures ({sum(g['count'] for g in known)}, manifest)</h2>"
                   f"<table><tr><th>backend</th><th>checks</th><th>check</th><th>cases</th>"
                   f"<th>reason</th><th>finding</th></tr>{known_rows}</table>") if known else ""
    accuracy = "".join(
        f"<tr><td>{html.escape(b)}</td><td>{html.escape(d)}</td><td><code>{html.escape(c)}"
        f"</code></td><td>{e:.3g}</td><td>{g:.3g}</td><td><code>{html.escape(case)}</code>"
        f"</td></tr>" for b, d, c, e, g, case in worst_errors(report["results"]))
    accuracy_table = ("<h2>Accuracy (worst error / budget per backend, dtype and check)</h2>"
                      "<table><tr><th>backend</th><th>dtype</th><th>check</th><th>error</th>"
                      f"<th>budget</th><th>case</th></tr>{accuracy}</table>") if accuracy else ""
    figures = [("Error against context length", error_figure(report))]
    if bench:
        figures.append(("Benchmarks against the bandwidth ceiling", bench_figure(bench)))
    images = "".join(f"<h2>{title}</h2><img alt='{title}' src='data:image/png;base64,{png}'>"
                     for title, png in figures if png)
    verdict = "PASS" if report.get("ok") else "FAIL"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Conformance: {verdict}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #999;padding:4px 8px;text-align:left}}img{{max-width:100%}}</style>
</head><body>
<h1>Paged decode conformance: {verdict}</h1>
<p>profile <b>{html.escape(str(report.get("profile")))}</b>, created
{html.escape(str(report.get("created")))}</p>
<table><tr><th>backend</th>{head}</tr>{body}</table>
{ran_where(report)}
{accuracy_table}
{images}
<h2>Unexpected failures ({len(failures)})</h2><ul>{failure_items}</ul>
{known_table}
</body></html>
"""


def write_html(report: dict, path: Path, bench: dict | None = None) -> None:
    path.write_text(render(report, bench))
