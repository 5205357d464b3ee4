"""The timeline page of ``ckrun status NAME --html FILE``: one self-contained HTML file.

Inline CSS and SVG only (no script, no font, no network), so it opens from disk and can
be mailed.  It draws, on one time axis (seconds from the run's start):

* one row per attempt, a bar split into its segments (start-up, restore, productive,
  saving, lost, shutdown, unsaved; :mod:`ckrun.report.goodput`), with its outcome;
* commits as ticks above the bar (step in the tooltip);
* notices as triangles with their source and lead time, refused requeues as crosses;
* waiting between attempts as a dashed line;

then the goodput and its breakdown (a stacked bar and a table) and the scheduler's own
record of the job when known.  Elements carry ``class``/``data-*`` attributes
(``seg seg-productive``, ``commit``, ``notice``) so tests can check the rendered DOM.
"""

from __future__ import annotations

import html
import json
from typing import Any

from ckrun.report.goodput import CATEGORIES

#: Fill colour of each category (also in the legend).
COLOURS = {
    "startup": "#9e9e9e",
    "restore": "#7e57c2",
    "productive": "#2e7d32",
    "saving": "#1565c0",
    "lost": "#c62828",
    "shutdown": "#cfcfcf",
    "unsaved": "#f9a825",
    "waiting": "#eeeeee",
}
LABELS = {
    "startup": "start-up",
    "restore": "restore",
    "productive": "productive training",
    "saving": "saving (loop stalled)",
    "lost": "lost (recomputed)",
    "shutdown": "shutdown",
    "unsaved": "training not yet saved",
    "waiting": "waiting (requeue, queue)",
}

LEFT, PLOT_W, ROW_H, BAR_H, TOP = 130, 820, 40, 20, 34

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 4px} .sub{color:#555;margin:0 0 16px}
table{border-collapse:collapse;margin:8px 0 16px} td,th{padding:2px 10px;text-align:left}
th{color:#555;font-weight:normal} td.n{text-align:right;font-variant-numeric:tabular-nums}
.sw{display:inline-block;width:12px;height:12px;margin-right:6px;vertical-align:-1px}
.legend span{margin-right:14px;white-space:nowrap} svg text{font:12px system-ui,sans-serif}
.goodput{font-size:28px;font-weight:600}
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _x(t: float, wall: float) -> float:
    return LEFT + (PLOT_W * t / wall if wall > 0 else 0.0)


def _timeline(s: dict[str, Any]) -> str:
    wall = max(float(s["wall_s"]), 1e-9)
    rows = s.get("attempt_detail") or []
    height = TOP + ROW_H * max(1, len(rows)) + 30
    out = [
        f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{LEFT + PLOT_W + 50}"'
        f' height="{height}" role="img" aria-label="attempts on a time axis">'
    ]
    axis_y = TOP + ROW_H * max(1, len(rows)) + 4
    out.append(
        f'<line class="axis" x1="{LEFT}" y1="{axis_y}" x2="{LEFT + PLOT_W}" y2="{axis_y}" '
        'stroke="#444"/>'
    )
    for i in range(6):
        t = wall * i / 5
        x = _x(t, wall)
        out.append(
            f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 5}" stroke="#444"/>'
            f'<text x="{x:.1f}" y="{axis_y + 18}" text-anchor="middle">{t:.1f} s</text>'
        )
    prev_end: float | None = None
    for r, a in enumerate(rows):
        y = TOP + ROW_H * r
        out.append(
            f'<g class="attempt" data-attempt="{a["attempt"]}" data-outcome="{_e(a["outcome"])}">'
            f'<text x="{LEFT - 8}" y="{y + BAR_H - 5}" text-anchor="end">#{a["attempt"]} '
            f"{_e(a['outcome'])}</text>"
        )
        if prev_end is not None and a["start_at_s"] > prev_end:
            x0, x1 = _x(prev_end, wall), _x(a["start_at_s"], wall)
            out.append(
                f'<line class="wait" x1="{x0:.1f}" y1="{y + BAR_H / 2}" x2="{x1:.1f}" '
                f'y2="{y + BAR_H / 2}" stroke="#888" stroke-dasharray="3 3">'
                f"<title>waiting {a['start_at_s'] - prev_end:.1f} s</title></line>"
            )
        prev_end = a["end_at_s"]
        for cat, t0, t1 in a["segments"]:
            x0, x1 = _x(t0, wall), _x(t1, wall)
            out.append(
                f'<rect class="seg seg-{cat}" data-category="{cat}" x="{x0:.2f}" y="{y}" '
                f'width="{max(0.5, x1 - x0):.2f}" height="{BAR_H}" fill="{COLOURS[cat]}">'
                f"<title>attempt {a['attempt']}: {LABELS[cat]} {t1 - t0:.2f} s "
                f"(+{t0:.1f} to +{t1:.1f} s)</title></rect>"
            )
        for c in a["commits"]:
            x = _x(c["at_s"], wall)
            out.append(
                f'<line class="commit" data-step="{c["step"]}" x1="{x:.1f}" y1="{y - 6}" '
                f'x2="{x:.1f}" y2="{y + BAR_H + 2}" stroke="#000" stroke-width="2">'
                f"<title>commit step {c['step']} (save {c['save_s']:.2f} s)</title></line>"
            )
        out.append("</g>")
    by_attempt = {a["attempt"]: TOP + ROW_H * r for r, a in enumerate(rows)}
    for n in s.get("notices") or []:
        y = by_attempt.get(n["attempt"], TOP) - 2
        x = _x(n["at_s"], wall)
        lead = "?" if n["lead_s"] is None else f"{n['lead_s']:g} s"
        out.append(
            f'<g class="notice" data-source="{_e(n["source"])}" data-lead="{n["lead_s"]}">'
            f'<path d="M{x - 6:.1f},{y - 9} L{x + 6:.1f},{y - 9} L{x:.1f},{y} Z" '
            f'fill="#ff6f00"/><text x="{x + (8 if x < LEFT + 0.7 * PLOT_W else -8):.1f}" '
            f'y="{y - 1}" text-anchor="{"start" if x < LEFT + 0.7 * PLOT_W else "end"}">'
            f"{_e(n['source'])}, "
            f"lead {lead}</text><title>{_e(n['kind'])} notice from {_e(n['source'])} at "
            f"+{n['at_s']:.1f} s, lead time {lead}</title></g>"
        )
    for rq in s.get("requeue_refusals") or []:
        yr = by_attempt.get(rq["attempt"], TOP) + BAR_H / 2
        x = _x(rq["at_s"], wall) + 8
        out.append(
            f'<g class="refusal"><path d="M{x - 5:.1f},{yr - 5} L{x + 5:.1f},{yr + 5} '
            f'M{x - 5:.1f},{yr + 5} L{x + 5:.1f},{yr - 5}" stroke="#b71c1c" stroke-width="3"/>'
            "<title>requeue refused</title></g>"
        )
    out.append("</svg>")
    return "".join(out)


def _breakdown(s: dict[str, Any]) -> str:
    wall = float(s["wall_s"])
    totals = {"productive": float(s["productive_s"]), **(s.get("overheads_s") or {})}
    x, parts, rows = 0.0, [], []
    for cat in CATEGORIES:
        v = float(totals.get(cat) or 0.0)
        w = PLOT_W * v / wall if wall > 0 else 0.0
        if w > 0:
            parts.append(
                f'<rect class="total total-{cat}" data-category="{cat}" x="{x:.2f}" y="0" '
                f'width="{w:.2f}" height="22" fill="{COLOURS[cat]}">'
                f"<title>{LABELS[cat]} {v:.2f} s</title></rect>"
            )
        x += w
        pct = f"{100 * v / wall:.1f} %" if wall > 0 else "-"
        rows.append(
            f'<tr><td><span class="sw" style="background:{COLOURS[cat]}"></span>'
            f'{LABELS[cat]}</td><td class="n">{v:.2f} s</td><td class="n">{pct}</td></tr>'
        )
    return (
        f'<svg id="breakdown" xmlns="http://www.w3.org/2000/svg" width="{PLOT_W}" height="22">'
        + "".join(parts)
        + "</svg><table>"
        + "".join(rows)
        + f'<tr><th>wall</th><td class="n">{wall:.2f} s</td><td></td></tr></table>'
    )


def _scheduler(job: dict[str, Any] | None) -> str:
    if not job:
        return "<p>No scheduler record (a local run).</p>"
    rows = []
    for k, v in job.items():
        if v is None:
            continue  # not known to the scheduler (or its tools are not installed here)
        val = json.dumps(v, default=str) if isinstance(v, (dict, list)) else str(v)
        rows.append(f"<tr><th>{_e(k)}</th><td>{_e(val)}</td></tr>")
    return f'<table id="scheduler">{"".join(rows)}</table>'


def render_html(s: dict[str, Any]) -> str:
    """The page for a :func:`ckrun.report.summary.summarize` record."""
    gp = "n/a" if s["goodput"] is None else f"{100 * s['goodput']:.1f} %"
    lost = "?" if s.get("lost_steps") is None else f"{s['lost_steps']:g}"
    legend = "".join(
        f'<span><i class="sw" style="background:{COLOURS[c]}"></i>{LABELS[c]}</span>'
        for c in CATEGORIES
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>ckrun run {_e(s['run'])}</title><style>{_CSS}</style></head><body>"
        f"<h1>run {_e(s['run'])}: {_e(s['state'])}</h1>"
        f'<p class="sub">started {_e(s.get("start_utc"))}; {s["attempts"]} attempts, '
        f"{s['preemptions']} preemption(s), {s['failures']} failure(s); newest committed step "
        f"{_e(s['last_committed_step'])}{'; complete' if s['complete'] else ''}</p>"
        f'<p>goodput <span class="goodput" id="goodput">{gp}</span> &nbsp; '
        f"{s['productive_s']:.1f} s productive of {s['wall_s']:.1f} s wall; "
        f"{s.get('productive_steps', 0)} steps kept, {lost} steps lost</p>"
        f'<div class="legend">{legend}</div>'
        f"<h2>Timeline</h2>{_timeline(s)}"
        f"<h2>Where the time went</h2>{_breakdown(s)}"
        f"<h2>Scheduler</h2>{_scheduler(s.get('scheduler'))}"
        "</body></html>\n"
    )
