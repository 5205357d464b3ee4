"""The import-layer check (tools/check_layers.py): on tiny fake trees, then on runner/."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "tools" / "check_layers.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_layers", TOOL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["check_layers"] = mod
    spec.loader.exec_module(mod)
    return mod


check_layers = _load()


def _tree(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "runner"
    for rel, text in {"__init__.py": "", **files}.items():
        p = pkg / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return pkg


def _messages(pkg: Path) -> list[str]:
    return [v.message for v in check_layers.check(pkg)]


def test_a_clean_tree_passes(tmp_path: Path) -> None:
    pkg = _tree(
        tmp_path,
        {
            "errors.py": "class E(Exception): ...\n",
            "storage/__init__.py": "",
            "storage/base.py": "from ckrun.errors import E\n",
            "checkpoint/__init__.py": "",
            "checkpoint/a.py": "from ckrun.storage import base\nfrom ..errors import E\n",
        },
    )
    assert _messages(pkg) == []
    assert check_layers.main([str(pkg)]) == 0


def test_a_cycle_fails_and_names_every_edge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pkg = _tree(
        tmp_path,
        {
            "checkpoint/__init__.py": "",
            "checkpoint/a.py": "from ckrun.checkpoint import b\n",
            # function-local imports count: they are how cycles hide
            "checkpoint/b.py": "def f():\n    from .a import g\n    return g\n",
        },
    )
    (msg,) = _messages(pkg)
    assert msg.startswith(
        "import cycle ckrun.checkpoint.a -> ckrun.checkpoint.b -> ckrun.checkpoint.a"
    )
    assert "a.py:1" in msg and "b.py:2" in msg
    assert check_layers.main([str(pkg)]) == 1
    assert "import cycle" in capsys.readouterr().out


def test_an_upward_import_fails_with_the_rule(tmp_path: Path) -> None:
    pkg = _tree(
        tmp_path,
        {
            "storage/__init__.py": "",
            "storage/base.py": "import typing\nif typing.TYPE_CHECKING:\n"
            "    import ckrun.checkpoint.tiering\n",
            "checkpoint/__init__.py": "",
            "checkpoint/tiering.py": "",
        },
    )
    (msg,) = _messages(pkg)
    assert "ckrun.storage.base -> ckrun.checkpoint.tiering: upward import" in msg
    assert "(storage imports checkpoint)" in msg and "errors/notices < storage" in msg


def test_a_private_name_of_another_module_fails(tmp_path: Path) -> None:
    pkg = _tree(
        tmp_path,
        {
            "checkpoint/__init__.py": "",
            "checkpoint/shard.py": "def _table(): ...\ndef _own(): return _table()\n",
            "checkpoint/host.py": "from ckrun.checkpoint.shard import _table\n",
            "checkpoint/other.py": "from ckrun.checkpoint import shard as fmt\nx = fmt._table\n"
            "y = fmt.__name__\n",
        },
    )
    msgs = sorted(_messages(pkg))
    assert len(msgs) == 2, msgs
    assert all("private name '_table'" in m for m in msgs)
    assert msgs[0].startswith("ckrun.checkpoint.host -> ckrun.checkpoint.shard._table")
    assert msgs[1].startswith("ckrun.checkpoint.other -> ckrun.checkpoint.shard._table")


def test_a_module_in_no_layer_fails(tmp_path: Path) -> None:
    pkg = _tree(tmp_path, {"misc.py": "", "errors.py": "import ckrun.misc\n"})
    (msg,) = _messages(pkg)
    assert "ckrun.misc is in no layer" in msg


def test_the_ckrun_package_keeps_its_layers() -> None:
    """runner/ itself: no cycles, no upward imports, no private names across modules."""
    proc = subprocess.run(
        [sys.executable, str(TOOL), str(REPO / "runner")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# "": the top level (errors, notices, control, control_files, runlog, ...)
@pytest.mark.parametrize(
    "room",
    [
        "",
        "storage",
        "checkpoint",
        "supervisor",
        "scheduler",
        "cli",
        "config",
        "cloud",
        "integrations",
        "report",
    ],
)
def test_modules_of_the_room_stay_under_400_lines(room: str) -> None:
    # issue 18: one concern per module, none over ~400 lines
    sizes = {p.name: len(p.read_text().splitlines()) for p in (REPO / "runner" / room).glob("*.py")}
    assert {n: s for n, s in sizes.items() if s > 400} == {}
