"""``ckrun status`` and ``ckrun runs`` as text: header, one bar per attempt, totals.

Each attempt's bar sits on the run's time axis (``width`` characters for the wall
time), one character per slice, the category that covers most of the slice::

    startup .   restore r   productive #   saving s   lost x   shutdown -   unsaved ~
"""

from __future__ import annotations

from typing import Any

from ckrun.report.lease_view import lease_line

#: One character per category of :data:`ckrun.report.goodput.CATEGORIES`.
GLYPH = {
    "startup": ".",
    "restore": "r",
    "productive": "#",
    "saving": "s",
    "lost": "x",
    "shutdown": "-",
    "unsaved": "~",
    "waiting": " ",
}

LEGEND = "bars: . start-up  r restore  # productive  s saving  x lost  - shutdown  ~ unsaved"


def bar(segments: list[list[Any]], wall_s: float, width: int = 48) -> str:
    """The attempt's bar: ``segments`` are ``[category, start_s, end_s]`` offsets."""
    if wall_s <= 0:
        return " " * width
    cells = []
    for i in range(width):
        lo, hi = wall_s * i / width, wall_s * (i + 1) / width
        best, cover = " ", 0.0
        for cat, s0, s1 in segments:
            c = min(hi, s1) - max(lo, s0)
            if c > cover:
                best, cover = GLYPH.get(cat, "?"), c
        cells.append(best)
    return "".join(cells)


def _s(x: float | None) -> str:
    return "?" if x is None else f"{x:.1f} s"


def render(s: dict[str, Any]) -> str:
    """Human-readable form of :func:`ckrun.report.summary.summarize`."""
    sup = s.get("supervisor") or {}
    live = f" (supervisor pid {sup.get('pid')} on {sup.get('host')})" if s["live"] else ""
    gp = f"{100 * s['goodput']:.1f}%" if s["goodput"] is not None else "n/a"
    marker = ", COMPLETE.json present" if s["complete"] else ""
    ov = s.get("overheads_s") or {}
    lost_steps = "?" if s.get("lost_steps") is None else f"{s['lost_steps']:g}"
    died = (
        " (its supervisor was killed; `ckrun submit` or `ckrun run` resumes)"
        if s["state"] == "SUPERVISOR_DIED"
        else ""
    )
    lines = [
        f"run {s['run']}: {s['state']}{live}{marker}{died}",
        f"  attempts {s['attempts']}, preemptions {s['preemptions']}, "
        f"failures {s['failures']}, last committed step {s['last_committed_step']}",
        f"  wall {s['wall_s']:.1f} s, useful {s['useful_s']:.1f} s, "
        f"saving {s['saving_s']:.2f} s, goodput {gp}",
        f"  overheads: start-up {_s(ov.get('startup'))}, restore {_s(ov.get('restore'))}, "
        f"saving {_s(ov.get('saving'))}, lost {_s(ov.get('lost'))} ({lost_steps} steps), "
        f"shutdown {_s(ov.get('shutdown'))}, waiting {_s(ov.get('waiting'))}"
        + (f", unsaved {_s(ov['unsaved'])}" if ov.get("unsaved") else ""),
    ]
    lease = lease_line(s.get("lease"))
    if lease:
        lines.append("  " + lease)
    iv = s.get("interval")
    if isinstance(iv, dict):
        lines.append("  " + interval_line(iv))
    job = s.get("scheduler")
    if job:
        extra = job.get("error") or ", ".join(
            f"{k} {v}"
            for k, v in job.items()
            if k not in ("backend", "job_id")
            and v not in (None, "", [], {})
            and not isinstance(v, (dict, list))
        )
        lines.append(f"  {job['backend']} job {job['job_id']}: {extra}")
    detail = s.get("attempt_detail") or []
    if detail:
        lines.append("  " + LEGEND)
        for a in detail:
            keep = "-" if a["kept_step"] is None else str(a["kept_step"])
            lines.append(
                f"  #{a['attempt']:<3}|{bar(a['segments'], s['wall_s'])}| "
                f"{a['outcome']:<10} productive {a['productive_s']:.1f} s to step {keep}"
                + ("" if a["measured"] else " (start-up not reported)")
            )
    shown = s["interruptions"]
    if len(shown) > 4:  # many drills: list only the interruptions that cost steps
        clean = [i for i in shown if i["lost_steps"] == 0]
        shown = [i for i in shown if i["lost_steps"] != 0]
        if clean:
            lines.append(
                f"  {len(clean)} interruption(s) lost no steps (their checkpoint committed)"
            )
    for i in shown:
        steps = "?" if i["lost_steps"] is None else f"{i['lost_steps']:g}"
        lines.append(
            f"  attempt {i['attempt']}: {i['interruption']} (status {i['status']}), "
            f"lost {i['lost_s']:.1f} s / {steps} steps"
        )
    notices = s.get("notices") or []
    if len(notices) <= 4:
        for n in notices:
            lead = "" if n["lead_s"] is None else f", lead {n['lead_s']:g} s"
            lines.append(f"  notice at +{n['at_s']:.1f} s: {n['kind']} from {n['source']}{lead}")
    else:  # one line per source: count and lead times
        parts = []
        for src in dict.fromkeys(n["source"] for n in notices):
            mine = [n for n in notices if n["source"] == src]
            leads = sorted({n["lead_s"] for n in mine if n["lead_s"] is not None})
            lead = (
                ""
                if not leads
                else f", lead {leads[0]:g} s"
                if len(leads) == 1
                else f", lead {leads[0]:g}-{leads[-1]:g} s"
            )
            parts.append(f"{len(mine)} from {src}{lead}")
        lines.append("  notices: " + "; ".join(parts) + " (--json or --html for each)")
    return "\n".join(lines)


def interval_line(iv: dict[str, Any]) -> str:
    """The checkpoint-interval line from :func:`ckrun.report.summary.interval_numbers`."""
    from ckrun.checkpoint.interval import IntervalEstimate

    if "error" in iv:
        return f"checkpoint interval (auto): {iv['error']}"
    return IntervalEstimate(
        iv["interval_s"],
        iv["save_cost_s"],
        iv["mtbi_s"],
        iv["mtbi_source"],
        iv["interruptions"],
        iv["exposure_s"],
        iv["expected_goodput"],
    ).describe()
