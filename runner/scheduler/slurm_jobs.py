"""Slurm helpers without side effects on the cluster: ids, time strings, job records,
states, messages, and the time-limit watcher (a :class:`~ckrun.notices.NoticeSource`).

Slurm prints times in the controller's local time without a zone (``EndTime=...`` in
``scontrol show job``, ``%e`` in ``squeue``); :func:`parse_slurm_time` reads them in the
local zone of this process (``TZ``), which is the controller's on every site that keeps
its nodes on one zone.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import threading
from collections.abc import Callable

from ckrun.errors import ConfigError
from ckrun.notices import TIME_LIMIT, Notice, iso_utc, utcnow
from ckrun.scheduler.base import JobState

log = logging.getLogger(__name__)

#: a job id ``scontrol``/``squeue``/``scancel`` accept from ckrun: ``123`` or ``123_4``.
JOB_ID_RE = re.compile(r"^[0-9]{1,12}(_[0-9]{1,9})?$")

# Slurm --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (sbatch(1) "-t, --time").
_TIME_RE = re.compile(
    r"^(?:(?P<d>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
    r"|(?P<a>\d+)(?::(?P<b>\d+)(?::(?P<c>\d+))?)?)$"
)

#: ``scontrol show job`` / ``squeue`` values that mean "no time here".
_NO_TIME = {"", "unknown", "n/a", "none", "unlimited", "(null)"}


def validate_job_id(job_id: str) -> str:
    """Return ``job_id`` stripped when it is a plain or array-task Slurm job id.

    Raises:
        ConfigError: anything else (the id goes into an argv; refusing odd text keeps a
            value such as ``"123 --all"`` or ``"-1"`` from ever reaching ``scontrol``).
    """
    jid = str(job_id).strip()
    if not JOB_ID_RE.match(jid):
        raise ConfigError(
            f"invalid Slurm job id {job_id!r}: expected digits, or ARRAYJOB_TASK such as "
            "'1234_5' for an array task"
        )
    return jid


def parse_time_limit_s(text: str) -> int:
    """Seconds in a Slurm ``--time`` value (``"90"`` is 90 minutes, ``"4:00:00"`` 4 h).

    Formats from sbatch(1): ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``.

    Raises:
        ConfigError: the value is not one of those formats, or is zero.
    """
    m = _TIME_RE.match(str(text).strip())
    if not m:
        raise ConfigError(
            f"invalid Slurm time {text!r}: use minutes, M:S, H:M:S or D-H:M:S, e.g. '4:00:00'"
        )
    g = {k: int(v) for k, v in m.groupdict().items() if v is not None}
    if "d" in g:
        secs = g["d"] * 86400 + g["dh"] * 3600 + g.get("dm", 0) * 60 + g.get("ds", 0)
    elif "c" in g:
        secs = g["a"] * 3600 + g["b"] * 60 + g["c"]
    elif "b" in g:
        secs = g["a"] * 60 + g["b"]
    else:
        secs = g["a"] * 60
    if secs <= 0:
        raise ConfigError(f"invalid Slurm time {text!r}: must be longer than zero")
    return secs


def check_lead_time(lead_s: int, limit_s: int, limit_text: str, fix: str) -> None:
    """Refuse a notice lead time that is not shorter than the job's time limit.

    sbatch(1) ``--signal``: "When a job is within sig_time seconds of its end time, send
    it the signal sig_num" (up to 60 s earlier, by the resolution of Slurm's timer).  A
    lead of the whole limit or more is therefore due from the job's start: Slurm sends
    the warning at its first timer check (measured 0.8 s after launch on 22.05) and
    ckrun's time-limit watcher fires at once as well, so every attempt would checkpoint
    and requeue straight away, without end.  Slurm accepts such a job, so ckrun refuses
    it: at ``ckrun submit`` (the profile's ``time`` and ``lead_s``) and when the
    supervisor starts in the job (``TimeLimit`` against ``CKRUN_LEAD_S``).

    Args:
        lead_s: the notice lead time in seconds.
        limit_s: the job's time limit in seconds.
        limit_text: how the limit was given (``time='2'``, ``the job's TimeLimit=00:02:00``).
        fix: what to change, appended to the message.

    Raises:
        ConfigError: ``lead_s`` is negative or not shorter than ``limit_s``; the message
            names both values and ``fix``.
    """
    if not 0 <= lead_s < limit_s:
        raise ConfigError(
            f"lead_s={lead_s} must be >= 0 and shorter than {limit_text} "
            f"({limit_s} s), else Slurm's warning is due at once and every attempt is "
            f"told to stop as it starts: {fix}"
        )


def parse_slurm_time(text: str) -> dt.datetime | None:
    """A Slurm timestamp (``2026-11-29T08:33:35``, local time) as aware UTC, or None.

    ``Unknown``, ``N/A``, ``NONE``, ``UNLIMITED`` and unparsable text give None.
    """
    s = text.strip()
    if s.lower() in _NO_TIME:
        return None
    try:
        t = dt.datetime.fromisoformat(s)
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.astimezone()  # naive: interpret in this process's local zone
    return t.astimezone(dt.timezone.utc)


def parse_job_record(text: str) -> dict[str, str]:
    """``scontrol show job -o`` output (one line of ``Key=Value`` tokens) as a dict.

    Values with spaces (``Command=``, ``WorkDir=`` on odd paths) are cut at the first
    space; the fields ckrun reads (JobState, Restarts, EndTime, Reason, Requeue,
    ArrayJobId, ArrayTaskId, TimeLimit) never contain one.
    """
    rec: dict[str, str] = {}
    for tok in text.split():
        key, sep, value = tok.partition("=")
        if sep and key and key not in rec:
            rec[key] = value
    return rec


# Slurm job states (squeue(1) "JOB STATE CODES") -> JobState.  PREEMPTED stays its own.
_STATE_MAP = {
    "PENDING": JobState.PENDING, "CONFIGURING": JobState.RUNNING,
    "RUNNING": JobState.RUNNING, "COMPLETING": JobState.RUNNING,
    "SUSPENDED": JobState.PENDING, "STOPPED": JobState.PENDING,
    "RESV_DEL_HOLD": JobState.PENDING, "SIGNALING": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING, "RESIZING": JobState.RUNNING,
    "REQUEUED": JobState.REQUEUED, "REQUEUE_HOLD": JobState.REQUEUED,
    "REQUEUE_FED": JobState.REQUEUED, "PREEMPTED": JobState.PREEMPTED,
    "COMPLETED": JobState.COMPLETED, "CANCELLED": JobState.CANCELLED,
    "REVOKED": JobState.CANCELLED, "TIMEOUT": JobState.TIMEOUT,
    "DEADLINE": JobState.TIMEOUT, "FAILED": JobState.FAILED,
    "NODE_FAIL": JobState.FAILED, "BOOT_FAIL": JobState.FAILED,
    "OUT_OF_MEMORY": JobState.FAILED, "SPECIAL_EXIT": JobState.FAILED,
}  # fmt: skip


def map_state(slurm_state: str) -> JobState:
    """A Slurm state word (``squeue %T``, sacct ``State``) as a :class:`JobState`."""
    return _STATE_MAP.get(slurm_state.strip().upper(), JobState.UNKNOWN)


def storage_base(run_root: str, run: str) -> str:
    """``run_root`` less its trailing ``/run`` (``ckrun run`` appends the name itself)."""
    root = run_root.rstrip("/")
    suffix = "/" + run
    return root[: -len(suffix)] if root.endswith(suffix) and len(root) > len(suffix) else root


class TimeLimitWatcher:
    """Notice source that fires ``lead_s`` seconds before the job's end time.

    Works without any ``--signal`` option: the end time is read from Slurm (``reader``,
    normally :meth:`SlurmScheduler.end_time`) by a daemon thread, first at once and then
    every ``refresh_s`` seconds, so an ``scontrol update TimeLimit=`` is picked up.
    :meth:`poll` only compares clocks and never blocks on Slurm.

    The notice: kind ``time_limit``, source ``slurm:time_limit``, deadline = the end time
    (Slurm enforces the limit 0-30 s after it, DESIGN.md §6), detail ``job_id``,
    ``end_utc``, ``lead_s``.  Reported once.
    """

    name = "slurm:time_limit"

    def __init__(
        self,
        job_id: str,
        lead_s: float,
        reader: Callable[[str], dt.datetime | None],
        *,
        refresh_s: float = 60.0,
        interval_s: float = 1.0,
        now: Callable[[], dt.datetime] = utcnow,
    ) -> None:
        """Start the reader thread.

        Args:
            job_id: the job (``123`` or ``123_4``) whose end time is read.
            lead_s: seconds before the end time at which the notice fires (>= 0).
            reader: returns the job's end time (aware UTC) or None when unknown; it may
                block (it runs on the watcher's thread) and should not raise.
            refresh_s: seconds between reads.
            interval_s: how often the supervisor needs to poll (advisory).
            now: clock, for tests.
        """
        self.job_id = job_id
        self.lead_s = float(lead_s)
        self.interval_s = interval_s
        self._reader = reader
        self._refresh_s = refresh_s
        self._now = now
        self._end: dt.datetime | None = None
        self._fired = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._read_once = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckrun-slurm-time", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                end = self._reader(self.job_id)
            except Exception as exc:  # a reader must not kill the watcher; log and retry
                log.warning("reading the end time of Slurm job %s failed: %s", self.job_id, exc)
                end = None
            if end is not None:
                with self._lock:
                    self._end = end
            self._read_once.set()
            self._stop.wait(self._refresh_s)

    @property
    def end_utc(self) -> dt.datetime | None:
        """The job's end time as last read (aware UTC), or None while unknown."""
        with self._lock:
            return self._end

    def wait_read(self, timeout_s: float) -> bool:
        """Block until the first read finished (tests, diagnostics); True when it did."""
        return self._read_once.wait(timeout_s)

    def poll(self) -> Notice | None:
        """The time-limit notice once ``now >= end - lead_s``; None before and after."""
        end = self.end_utc
        if self._fired or end is None:
            return None
        now = self._now()
        if now < end - dt.timedelta(seconds=self.lead_s):
            return None
        self._fired = True
        detail = {"job_id": self.job_id, "end_utc": iso_utc(end), "lead_s": self.lead_s}
        return Notice(TIME_LIMIT, self.name, now, end, detail)

    def close(self) -> None:
        """Stop the reader thread (returns at once; the thread is a daemon)."""
        self._stop.set()
