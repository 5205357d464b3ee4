"""Manifest and completion-marker parsing: round trip and every rejected input."""

from __future__ import annotations

import json
from typing import Any

import pytest
from ckrun.checkpoint import layout
from ckrun.checkpoint.manifest import Manifest, ShardInfo, UnsupportedFormat
from ckrun.checkpoint.marker import CompletionMarker
from ckrun.errors import CorruptCheckpoint


def _manifest(**kw: Any) -> Manifest:
    key = layout.shard_key(7, 0, 2)
    base: dict[str, Any] = dict(
        run="r",
        step=7,
        kind="recovery",
        attempt=2,
        world_size=1,
        shards=(ShardInfo(key, 0, 100, "crc32c:0000abcd"),),
        compat={"config": {"lr": 0.1}},
        metrics={"loss": 1.5},
        resumed_from=3,
        created_utc="2026-01-01T00:00:00.000000Z",
        committed_utc="2026-01-01T00:00:01.000000Z",
        save_duration_s=1.25,
        versions={"ckrun": "0.1.0"},
        compat_drift=("config.lr: 0.2 → 0.1",),
        key=layout.manifest_key(7),
    )
    base.update(kw)
    return Manifest(**base)


def test_roundtrip() -> None:
    m = _manifest()
    back = Manifest.loads(m.dumps(), key=m.key)
    assert back == m and back.total_size_bytes == 100 and back.save_duration_s == 1.25
    body = json.loads(m.dumps())
    assert body["format"] == "ckrun.manifest" and body["format_version"] == 1
    assert "/" not in body["run"] and not any(s["key"].startswith("/") for s in body["shards"])


def _mutated(edit: Any) -> bytes:
    body = json.loads(_manifest().dumps())
    edit(body)
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda b: b["shards"][0].update(key="../../etc/passwd"), "rejected"),
        (lambda b: b["shards"][0].update(key="/abs/shard.ckpt"), "rejected"),
        (lambda b: b["shards"][0].update(key="checkpoints/step-0000000007/../x"), "rejected"),
        (lambda b: b["shards"][0].update(key="run.json"), "not a ckrun shard"),
        (lambda b: b["shards"][0].update(key=layout.shard_key(8, 0, 1)), "not a ckrun shard"),
        (lambda b: b["shards"][0].update(checksum="sha256:abc"), "checksum"),
        (lambda b: b["shards"][0].update(size_bytes=-1), "negative"),
        (lambda b: b.update(world_size=2), "ranks"),
        (lambda b: b.update(kind="weird"), "kind"),
        (lambda b: b.update(step="7"), "step"),
        (lambda b: b.update(extra_field=1), "unknown fields"),
        (lambda b: b.pop("compat"), "missing fields"),
        (lambda b: b.update(save_duration_s="fast"), "save_duration_s"),
        (lambda b: b.update(resumed_from=True), "resumed_from"),
    ],
)
def test_rejected(edit: Any, match: str) -> None:
    with pytest.raises(CorruptCheckpoint, match=match):
        Manifest.loads(_mutated(edit), key="m")


@pytest.mark.parametrize("data", [b"", b"{", b"[]", b"null", b'{"a": NaN}', b"\xff\xfe"])
def test_unparsable(data: bytes) -> None:
    with pytest.raises(CorruptCheckpoint):
        Manifest.loads(data, key="m")


@pytest.mark.parametrize("version", [3, 0, "1", None])  # 2: tensor_layout (issue 14)
def test_unknown_version(version: Any) -> None:
    with pytest.raises(UnsupportedFormat, match="format_version"):
        Manifest.loads(_mutated(lambda b: b.update(format_version=version)), key="m")


def test_final_manifest_keys_live_under_final() -> None:
    key = layout.shard_key(9, 0, 0, "final")
    m = _manifest(step=9, kind="final", shards=(ShardInfo(key, 0, 1, "crc32c:00000001"),))
    assert Manifest.loads(m.dumps()).area == "final"
    with pytest.raises(CorruptCheckpoint):
        Manifest.loads(_manifest(kind="final").dumps())


def test_marker_roundtrip_and_rejects() -> None:
    key = layout.shard_key(9, 0, 0, "final")
    m = _manifest(
        step=9,
        kind="final",
        shards=(ShardInfo(key, 0, 1, "crc32c:00000001"),),
        key=layout.manifest_key(9, "final"),
        compat={"launch_hash": "h1"},
    )
    mk = CompletionMarker.for_manifest(m)
    back = CompletionMarker.loads(mk.dumps())
    assert back == mk and back.config_hash == "h1" and back.shard_count == 1
    body = json.loads(mk.dumps())
    body["shard_count"] = 2
    with pytest.raises(CorruptCheckpoint, match="shard_count"):
        CompletionMarker.loads(json.dumps(body).encode())
    body["shard_count"], body["format_version"] = 1, 5
    with pytest.raises(UnsupportedFormat):
        CompletionMarker.loads(json.dumps(body).encode())
    with pytest.raises(CorruptCheckpoint):
        CompletionMarker.loads(b"not json")


def test_layout_parse() -> None:
    k = layout.shard_key(12, 3, 45)
    p = layout.parse(k)
    assert p is not None and (p.step, p.rank, p.attempt, p.is_manifest) == (12, 3, 45, False)
    assert layout.parse("checkpoints/step-0000000012/manifest.json") is not None
    for foreign in [
        "run.json",
        "checkpoints/notes.txt",
        "checkpoints/step-12/manifest.json",
        "checkpoints/step-0000000012/shard-r0-a1-x.ckpt",
        "events.jsonl",
    ]:
        assert layout.parse(foreign) is None


def test_utc_now_is_iso_8601_utc_with_microseconds() -> None:
    """The stamps of every manifest: ``YYYY-MM-DDTHH:MM:SS.ffffffZ``, the current UTC
    time (as ``datetime`` formats it, which the readers parse)."""
    import re
    from datetime import datetime, timezone

    from ckrun.checkpoint.manifest import utc_now

    before = datetime.now(timezone.utc)
    stamp = utc_now()
    after = datetime.now(timezone.utc)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", stamp), stamp
    parsed = datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)
    assert before.replace(microsecond=0) <= parsed <= after


@pytest.mark.parametrize(
    "ns",
    [
        0,
        86_399_999_999_000,  # the last microsecond of a day, then the next day's first
        86_400_000_000_000,
        951_782_400_000_001_000,  # 2000-02-29, a leap day
        1_764_921_242_123_456_789,  # nanoseconds below a microsecond are cut, not rounded
        4_102_444_799_999_999_000,  # 2099-12-31T23:59:59.999999
    ],
)
def test_utc_now_formats_each_instant_as_datetime_does(
    ns: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``utc_now`` keeps the date of the day it last formatted and builds the time of
    day by arithmetic: the same text as ``datetime`` at day boundaries and leap days,
    including after an earlier stamp of another day."""
    import time
    from datetime import datetime, timedelta, timezone

    from ckrun.checkpoint import manifest

    want = datetime(1970, 1, 1, tzinfo=timezone.utc) + timedelta(microseconds=ns // 1000)
    for earlier in (ns - 86_400 * 10**9, ns):  # another day's date kept first, then its own
        first = max(earlier, 0)
        monkeypatch.setattr(time, "time_ns", lambda v=first: v)
        manifest.utc_now()
        monkeypatch.setattr(time, "time_ns", lambda: ns)
        assert manifest.utc_now() == want.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def test_utc_now_keeps_its_own_day_when_another_thread_changes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two threads stamping either side of midnight: one replaces the kept date between
    the other's check of it and its use.  Simulated deterministically (white-box): the
    time-of-day arithmetic after the check stamps an instant of the day before, as the
    other thread would in between; each stamp keeps the date of its own instant."""
    import builtins
    import time

    from ckrun.checkpoint import manifest

    day = 20_000 * 86_400 * 10**9  # midnight of 2024-10-04 UTC, in ns
    monkeypatch.setattr(time, "time_ns", lambda: day)
    assert manifest.utc_now() == "2024-10-04T00:00:00.000000Z"  # the date kept
    inner: list[str] = []

    def divmod_(a: int, b: int) -> tuple[int, int]:
        if b == 3600 and not inner:  # after the date check: the other thread stamps
            inner.append("")
            monkeypatch.setattr(time, "time_ns", lambda: day - 1000)
            inner[0] = manifest.utc_now()
            monkeypatch.setattr(time, "time_ns", lambda: day)
        return builtins.divmod(a, b)

    monkeypatch.setattr(manifest, "divmod", divmod_, raising=False)
    assert manifest.utc_now() == "2024-10-04T00:00:00.000000Z"
    assert inner == ["2024-10-03T23:59:59.999999Z"]
