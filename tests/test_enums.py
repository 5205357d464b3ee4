"""Named values are enums (a str subclass equal to the old word): notice kinds, manifest
kinds, preflight and requeue outcomes; one definition of a terminal supervisor state."""

from __future__ import annotations

import dataclasses
import json

import pytest
from ckrun.checkpoint import layout
from ckrun.checkpoint.manifest import KINDS, Manifest, ManifestKind, ShardInfo
from ckrun.notices import PREEMPTION, Notice, NoticeKind
from ckrun.supervisor import machine as sm


def test_notice_kind_round_trips_as_its_word() -> None:
    n = Notice.with_lead("preemption", "aws", 60)
    assert n.kind is NoticeKind.PREEMPTION and n.kind == PREEMPTION == "preemption"
    assert f"{n.kind}" == str(n.kind) == "preemption"
    body = json.loads(json.dumps(n.to_json()))
    assert body["kind"] == "preemption"
    assert Notice.from_json(body).kind is NoticeKind.PREEMPTION
    with pytest.raises(ValueError):
        Notice.from_json({**body, "kind": "meteor"})


def test_manifest_kind_parses_to_the_enum() -> None:
    key = layout.manifest_key(5, "checkpoints")
    shard = ShardInfo(layout.shard_key(5, 0, 0, "checkpoints"), 0, 10, "crc32c:0000abcd")
    m = Manifest(
        run="r",
        step=5,
        kind=ManifestKind.MILESTONE,
        attempt=0,
        world_size=1,
        shards=(shard,),
        compat={},
        metrics={},
        resumed_from=None,
        created_utc="2026-01-01T00:00:00Z",
        committed_utc="2026-01-01T00:00:01Z",
        save_duration_s=1.0,
        key=key,
    )
    back = Manifest.loads(m.dumps(), key=key)
    assert back.kind is ManifestKind.MILESTONE and back.kind == "milestone"
    assert json.loads(m.dumps())["kind"] == "milestone"
    assert set(KINDS) == {"recovery", "milestone", "final"}


def test_outcomes_are_enums_and_terminal_has_one_definition() -> None:
    assert sm.Preflighted("ready").outcome == sm.PreflightOutcome.READY
    assert {o.value for o in sm.RequeueResult} == {"restart_here", "requeued", "failed"}
    s = sm.State()
    assert not s.terminal
    assert dataclasses.replace(s, phase=sm.Phase.FAILED).terminal
    preempted = dataclasses.replace(s, phase=sm.Phase.PREEMPTED, exit_code=75)
    assert preempted.terminal and sm.step(preempted, sm.Tick(0.0)) == (preempted, [])
