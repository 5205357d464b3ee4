"""The timeline page (``ckrun status NAME --html FILE``) of a scripted history, rendered
by headless Chromium: the DOM it built and the pixels it drew."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from browser import Elements, colour_counts, dump_dom, screenshot
from ckrun.report.timeline_html import COLOURS, render_html
from report_scripted import stormy

CKRUN = str(Path(sys.executable).with_name("ckrun"))


def _page(tmp_path: Path) -> Path:
    stormy().write(tmp_path / "runs", "REQUEUE_FAILED", 77)
    page = tmp_path / "page.html"
    r = subprocess.run(
        [CKRUN, "status", "r", "--storage", str(tmp_path / "runs"), "--html", str(page)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert "goodput 54.5%" in r.stdout and "timeline page" in r.stderr
    return page


def test_page_is_self_contained_and_structured(tmp_path: Path) -> None:
    text = _page(tmp_path).read_text()
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in text and "<script" not in text and "<link" not in text
    el = Elements(text)
    assert [a["data-attempt"] for a in el.having("g", "attempt")] == ["0", "1", "2", "3"]
    assert [a["data-outcome"] for a in el.having("g", "attempt")] == [
        "preempted", "failure", "preempted", "preempted",
    ]  # fmt: skip
    cats = {a["data-category"] for a in el.having("rect", "seg")}
    assert cats == {"startup", "restore", "productive", "saving", "lost", "shutdown"}
    assert [a["data-step"] for a in el.having("line", "commit")] == [
        "10", "20", "25", "40", "50", "60",
    ]  # fmt: skip
    assert [(a["data-source"], a["data-lead"]) for a in el.having("g", "notice")] == [
        ("chaos", "60.0"),
        ("aws", "120.0"),
        ("signal:SIGUSR1", "30.0"),
    ]
    assert len(el.having("g", "refusal")) == 1
    assert "No scheduler record" in text


def test_chromium_builds_the_dom_and_draws_the_bars(tmp_path: Path) -> None:
    page = _page(tmp_path)
    dom = Elements(dump_dom(page))
    assert len(dom.having("g", "attempt")) == 4
    assert len(dom.having("line", "commit")) == 6
    assert len(dom.having("g", "notice")) == 3
    assert {a["data-category"] for a in dom.having("rect", "total")} >= {"productive", "lost"}
    png = screenshot(page, tmp_path / "page.png")
    px = colour_counts(png, COLOURS)
    # Each category is drawn twice at the same horizontal scale: in the attempts' bars
    # (20 px tall) and in the breakdown bar (22 px tall), so pixel areas are proportional
    # to the seconds: productive 21.0 s, lost 4.0 s, start-up 6.0 s, saving 2.7 s.
    assert px["productive"] > 10_000, px
    assert px["productive"] / px["lost"] == pytest.approx(21.0 / 4.0, rel=0.1), px
    assert px["startup"] / px["lost"] == pytest.approx(6.0 / 4.0, rel=0.15), px
    assert px["saving"] > 0 and px["restore"] > 0, px


def test_page_of_an_empty_run_renders(tmp_path: Path) -> None:
    from report_scripted import Script

    rd = Script().write(tmp_path)
    from ckrun.cli import status as runstatus

    s = runstatus.summarize(rd)
    page = render_html(s)
    assert "<svg" in page and s["attempts"] == 0 and s["goodput"] is None


GOLDEN = Path(__file__).with_name("golden") / "stormy.skeleton.txt"


def skeleton(text: str) -> str:
    """The page's structure: one line per element with a class or an id (tag, id, class,
    ``data-*``), without coordinates or text; regenerate with ``CKRUN_UPDATE_GOLDEN=1``."""
    lines = []
    for tag, a in Elements(text).tags:
        if "class" not in a and "id" not in a:
            continue
        data = " ".join(f"{k}={a[k]}" for k in sorted(a) if k.startswith("data-"))
        lines.append(f"{tag} #{a.get('id', '')} .{a.get('class', '')} {data}".rstrip())
    return "\n".join(lines) + "\n"


def test_golden_structure_of_the_scripted_page(tmp_path: Path) -> None:
    import os

    text = skeleton(_page(tmp_path).read_text())
    if os.environ.get("CKRUN_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), f"page changed; CKRUN_UPDATE_GOLDEN=1 rewrites {GOLDEN}"


def test_scheduler_record_is_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from ckrun.cli import status as runstatus

    rd = stormy().write(tmp_path / "runs", "REQUEUE_FAILED", 77)
    Path(rd.job_json).write_text(json.dumps({"backend": "slurm", "job_id": "4242"}))
    (tmp_path / "empty-bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no squeue/sacct here
    text = render_html(runstatus.summarize(rd))
    assert any(t == "table" and a.get("id") == "scheduler" for t, a in Elements(text).tags)
    assert "<th>backend</th><td>slurm</td>" in text and "<th>job_id</th><td>4242</td>" in text
    assert "No scheduler record" not in text
