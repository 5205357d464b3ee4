"""Headless Chromium for the timeline page tests: ``--screenshot`` and ``--dump-dom``.

Debian's ``chromium`` package (``.ci/run`` installs it).  Without it the tests skip with
the reason, unless ``CKRUN_REQUIRE_BROWSER=1`` (set by ``.ci/run``), which fails them.
Each call uses a fresh profile directory and no network features.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
]


def chromium() -> str:
    """The browser's path; skips (or fails under ``CKRUN_REQUIRE_BROWSER=1``) without it."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if os.environ.get("CKRUN_REQUIRE_BROWSER", "") not in ("", "0"):
            pytest.fail(
                "CKRUN_REQUIRE_BROWSER=1 but chromium is not installed (apt-get install chromium)"
            )
        pytest.skip("chromium not found: apt-get install -y chromium (CI installs it)")
    return exe


def _run(args: list[str]) -> subprocess.CompletedProcess[bytes]:
    with tempfile.TemporaryDirectory(prefix="ckrun-chromium-") as profile:
        return subprocess.run(
            [chromium(), *FLAGS, f"--user-data-dir={profile}", *args],
            capture_output=True,
            timeout=120,
            check=False,
        )


def screenshot(page: Path, png: Path, width: int = 1100, height: int = 1400) -> Path:
    """Render ``page`` and write a ``width`` x ``height`` PNG."""
    r = _run([f"--window-size={width},{height}", f"--screenshot={png}", page.as_uri()])
    assert png.exists() and png.stat().st_size > 1000, r.stderr.decode(errors="replace")[-2000:]
    return png


def dump_dom(page: Path) -> str:
    """The DOM the browser built for ``page``, serialised."""
    r = _run(["--dump-dom", page.as_uri()])
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-2000:]
    return r.stdout.decode()


class Elements(HTMLParser):
    """Every start tag with its attributes, in document order."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, {k: v or "" for k, v in attrs}))

    def having(self, tag: str, cls: str) -> list[dict[str, str]]:
        """Attributes of the ``tag`` elements whose class list holds ``cls``."""
        return [a for t, a in self.tags if t == tag and cls in a.get("class", "").split()]


def colour_counts(png: Path, colours: dict[str, str]) -> dict[str, int]:
    """Pixels of exactly each ``#rrggbb`` colour in the PNG."""
    from PIL import Image

    img = Image.open(png).convert("RGB")
    hist: dict[tuple[int, int, int], int] = {}
    for count, rgb in img.getcolors(maxcolors=1 << 20) or []:
        hist[rgb] = count
    out = {}
    for name, hexa in colours.items():
        rgb = tuple(int(hexa[i : i + 2], 16) for i in (1, 3, 5))
        out[name] = hist.get(rgb, 0)  # type: ignore[call-overload]
    return out
