"""The supervisor loop: executes :mod:`ckrun.supervisor.machine`'s actions on real processes.

The pure ``step(state, event) -> (state, actions)`` (DESIGN.md §4.5) lives in
:mod:`ckrun.supervisor.machine` (events and actions in :mod:`ckrun.supervisor.messages`) and is
re-exported here.

One thread, ticking every ``tick_s`` (0.2 s) or sooner when a signal arrives (the
handlers only record the signal number; ``signal.set_wakeup_fd`` wakes the ``select``).
Each round it

1. drains the recorded signals: SIGTERM and the notice signal (default USR1) become
   notices, INT/HUP/QUIT are forwarded to the child's group, USR2 and CHLD only wake;
2. takes ``ckrun preempt`` / ``ckrun cancel`` requests from ``control/``, and a peer
   notice (``peer-notice.json``: the child's ranks agreed to stop for a notice that
   reached another node of a multi-node job, :func:`ckrun.control.write_peer_notice`),
   which drains this node like a notice of its own, without a restart in place;
3. polls the notice sources (scheduler's, cloud, chaos);
4. reaps with ``waitpid(-1, WNOHANG)`` (it alone waits: orphans adopted in subreaper
   mode are reaped too); the attempt ends when the child is reaped *and* no process of
   its session is left, then the newest commit in storage is read (the supervisor checks
   the checkpoint itself, not the child's word).  A peer notice left before the child's
   end is taken first, so the exit is judged as a drain's;
5. feeds a ``Tick`` (deadlines, backoff).

Stray processes left in the session after the direct child exited without a notice get
``grace_s`` to finish (they may be saving: a ``bash -c`` wrapper killed by a signal
leaves the trainer behind), then TERM and, ``kill_delay_s`` later, KILL.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from ckrun import control
from ckrun.config import RunConfig, is_local_storage, storage_env
from ckrun.errors import CkrunError
from ckrun.notices import (
    DRILL,
    PREEMPTION,
    TERMINATION,
    TIME_LIMIT,
    Notice,
    NoticeSource,
    utcnow,
)
from ckrun.runlog import EventLog
from ckrun.scheduler.base import JobInfo, RequeueOutcome, Scheduler
from ckrun.storage.base import Storage
from ckrun.supervisor import machine as sm
from ckrun.supervisor import process
from ckrun.supervisor.machine import Phase, Policy, State, step
from ckrun.supervisor.rundir import CANCEL_REQUEST, PREEMPT_REQUEST, RunDir, SupervisorLock

__all__ = ["Phase", "Policy", "State", "Supervisor", "step"]  # step: the pure machine

_FORWARD = (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class Supervisor:
    """Supervises one run until it completes, fails, or is requeued elsewhere.

    Args:
        cfg: the frozen run config.
        rundir: the run's state directory (its lock must already be held: ``lock``).
        scheduler: backend used for ``requeue``.
        job: the job this supervisor runs in (``scheduler.current()``).
        sources: notice sources polled every round.
        lock: the held supervisor lock (its holder record gets the attempt number).
        out: where ``[ckrun]`` lines go (default stderr).
        tick_s: loop period in seconds.
    """

    def __init__(
        self,
        cfg: RunConfig,
        rundir: RunDir,
        scheduler: Scheduler,
        job: JobInfo | None,
        sources: list[NoticeSource],
        *,
        lock: SupervisorLock | None = None,
        out: IO[str] | None = None,
        tick_s: float = 0.2,
    ) -> None:
        self.cfg, self.rundir, self.scheduler, self.job = cfg, rundir, scheduler, job
        self.sources, self.lock, self.tick_s = sources, lock, tick_s
        self.out = out or sys.stderr
        self.notice_sig = cfg.signal_number()
        self.events = EventLog(rundir.events_path, cfg.run)
        self.child: process.Child | None = None
        self._storage: Storage | None = None
        self._signals: collections.deque[int] = collections.deque()
        self._queue: collections.deque[sm.Event] = collections.deque()
        self._strays_term_at: float | None = None
        self._strays_kill_at: float | None = None
        self._last_notice: Notice | None = None
        self._delivered: list[int] | None = None
        self._wake_r = -1
        self.state = sm.State(
            policy=sm.Policy(
                max_requeues=cfg.max_requeues,
                max_failures=cfg.max_failures,
                crash_loop_failures=cfg.crash_loop_failures,
                grace_s=cfg.grace_s,
                margin_s=cfg.margin_s,
                kill_delay_s=cfg.kill_delay_s,
                backoff_s=cfg.backoff_s,
                backoff_max_s=cfg.backoff_max_s,
            )
        )

    # ------------------------------------------------------------ plumbing
    @property
    def storage(self) -> Storage:
        """The run root's storage (opened on first use)."""
        if self._storage is None:
            from ckrun.supervisor.preflight import open_run_storage

            self._storage = open_run_storage(self.cfg)
        return self._storage

    def say(self, message: str) -> None:
        """Print one ``[ckrun]`` line."""
        print(
            f"[ckrun] {self.cfg.run} attempt {self.events.attempt}: {message}",
            file=self.out,
            flush=True,
        )

    def _handler(self, signum: int, frame: object) -> None:
        self._signals.append(signum)

    def _install(self) -> Callable[[], None]:
        sigs = {signal.SIGTERM, self.notice_sig, signal.SIGUSR2, signal.SIGCHLD, *_FORWARD}
        old = {s: signal.signal(s, self._handler) for s in sigs}
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._wake_r = r

        def restore() -> None:
            signal.set_wakeup_fd(old_fd)
            for s, h in old.items():
                signal.signal(s, h)
            os.close(r)
            os.close(w)

        return restore

    # ------------------------------------------------------------ main loop
    def run(self) -> int:
        """Run to the end; returns the exit code (DESIGN.md §3 exit codes).

        Raises:
            CkrunError: storage unusable during preflight (exit 5), and similar.
        """
        restore = self._install()
        subreaper = process.become_subreaper()
        for stale in (PREEMPT_REQUEST, CANCEL_REQUEST):  # left by a dead supervisor
            self.rundir.take_request(stale)
        self.state = dataclasses.replace(self.state, attempt=self._prior_attempts())
        self.events.attempt = self.state.attempt
        job = self.job
        self.events.append(
            "supervisor_start",
            pid=os.getpid(),
            subreaper=subreaper,
            backend=self.scheduler.name,
            launch_hash=self.cfg.launch_hash(),
            job_id=job.job_id if job else None,
            rank=job.rank if job else 0,
        )
        if job is not None and job.backend != "local":
            self.say(
                f"supervising {job.backend} job {job.job_id} rank {job.rank} (pid {os.getpid()})"
            )
        try:
            self._queue.append(self._preflight())
            while True:
                while self._queue:
                    self._feed(self._queue.popleft())
                if self.state.terminal:
                    break
                self._round()
        finally:
            self._abandon()
            for src in self.sources:
                src.close()
            restore()
        code = int(self.state.exit_code or 0)
        self.events.append("supervisor_exit", exit_code=code, state=self.state.phase.value)
        return code

    def _round(self) -> None:
        select.select([self._wake_r], [], [], self.tick_s)
        try:
            while os.read(self._wake_r, 512):
                pass
        except BlockingIOError:
            pass
        now = time.monotonic()
        while self._signals:
            self._on_signal(self._signals.popleft(), now)
        self._requests(now)
        self._peer_notice(now)
        for src in self.sources:
            n = src.poll()
            if n is not None:  # a cloud/scheduler notice means this machine goes away
                self._queue.append(self._notice_event(n, now, self_term=n.kind != DRILL))
        self._reap(now)
        self._queue.append(sm.Tick(time.monotonic()))

    def _feed(self, ev: sm.Event) -> None:
        self.state, actions = sm.step(self.state, ev)
        for a in actions:
            follow = self._execute(a)
            if follow is not None:
                self._queue.append(follow)

    # ------------------------------------------------------------ inputs
    def _notice_event(self, n: Notice, now: float, **kw: Any) -> sm.NoticeEvent:
        self._last_notice = n
        return sm.NoticeEvent(n.kind, n.source, now + n.seconds_left(), now, **kw)

    def _on_signal(self, sig: int, now: float) -> None:
        name = signal.Signals(sig).name
        if sig == signal.SIGTERM:
            n = Notice.with_lead(TERMINATION, f"signal:{name}", self.cfg.grace_s)
            self._queue.append(self._notice_event(n, now, self_term=True))
        elif sig == self.notice_sig:
            # Slurm's --signal lead time warns of the time limit, not of a preemption
            kind = (
                TIME_LIMIT if self.job is not None and self.job.backend == "slurm" else PREEMPTION
            )
            n = Notice.with_lead(kind, f"signal:{name}", self.cfg.grace_s)
            self._queue.append(self._notice_event(n, now))
        elif sig in _FORWARD:
            self._queue.append(sm.Forward(sig, now))

    def _requests(self, now: float) -> None:
        req = self.rundir.take_request(PREEMPT_REQUEST)
        if req is not None:
            lead = float(req.get("lead_s") or self.cfg.grace_s)
            n = Notice.with_lead(DRILL, "cli:preempt", lead, {"requested_by": req})
            self._queue.append(self._notice_event(n, now))
        req = self.rundir.take_request(CANCEL_REQUEST)
        if req is not None:
            n = Notice.with_lead(TERMINATION, "cli:cancel", self.cfg.grace_s)
            self._queue.append(self._notice_event(n, now, cancel=True))

    def _peer_notice(self, now: float) -> None:
        """Drain on a peer notice.  Not ``self_term``: this machine stays; the scheduler
        decides (Kubernetes, Slurm: requeued, exit 75; the local backend restarts here)."""
        body = control.take_peer_notice(self.rundir.control_dir)
        if body is not None:
            n = Notice.with_lead(PREEMPTION, "peer:agreed-step", self.cfg.grace_s, body)
            self._queue.append(self._notice_event(n, now))

    def _reap(self, now: float) -> None:
        reaped = process.reap()
        c = self.child
        if c is None:
            return
        if c.pid in reaped:
            c.status, c.exited = reaped[c.pid], now
        if c.status is None:
            if c.sids is not None:  # torchrun: learn the workers' sessions while it lives
                from ckrun.supervisor.torchrun import track

                track(c.pid, c.sids, now)
            return
        if process.session_alive(c):
            self._strays(c, now)
            return
        self._peer_notice(now)  # a peer notice left before the end is judged first
        self.child = None
        self._strays_term_at = self._strays_kill_at = None
        from ckrun.supervisor.preflight import attempt_commits, is_complete, newest

        step, save_s = newest(self.storage)
        self.events.append(
            "attempt_end",
            status=c.status,
            seconds=now - c.started,
            commits=attempt_commits(self.storage, self.events.attempt),
        )
        self._queue.append(
            sm.ChildExited(c.status, step, is_complete(self.storage), time.monotonic(), save_s)
        )

    def _strays(self, c: process.Child, now: float) -> None:
        """Direct child gone, session not empty: wait, TERM, KILL (see module docstring)."""
        if self.state.phase is not sm.Phase.RUNNING:
            return  # draining/stopping: the state machine's deadlines apply
        assert c.exited is not None
        if self._strays_term_at is None:
            self._strays_term_at = c.exited + self.cfg.grace_s
            self.say(
                f"child exited ({c.status}) but its session has processes left; "
                f"waiting up to {self.cfg.grace_s:g} s for them"
            )
        elif self._strays_kill_at is None and now >= self._strays_term_at:
            self._strays_kill_at = now + self.cfg.kill_delay_s
            process.signal_session(c, signal.SIGTERM)
        elif self._strays_kill_at is not None and now >= self._strays_kill_at:
            process.signal_session(c, signal.SIGKILL)

    # ------------------------------------------------------------ actions
    def _execute(self, a: sm.Action) -> sm.Event | None:
        if isinstance(a, sm.Log):
            self._log(a)
        elif isinstance(a, sm.RunPreflight):
            return self._preflight()
        elif isinstance(a, sm.Spawn):
            return self._spawn(a)
        elif isinstance(a, sm.WriteNotice):
            n = self._last_notice
            detail = dict(n.detail) if n is not None and n.source == a.source else {}
            control.write_notice(
                self.rundir.control_dir, Notice.with_lead(a.kind, a.source, a.seconds_left, detail)
            )
        elif isinstance(a, sm.Deliver) and self.child is not None:
            self._delivered = process.deliver(self.child, self.notice_sig)
        elif isinstance(a, sm.SignalGroup) and self.child is not None:
            process.signal_session(self.child, a.sig)
        elif isinstance(a, sm.Escalate) and self.child is not None:
            control.write_escalation(self.rundir.control_dir)
            process.signal_session(self.child, signal.SIGTERM)
        elif isinstance(a, sm.Kill) and self.child is not None:
            process.signal_session(self.child, signal.SIGKILL)
        elif isinstance(a, sm.Requeue):
            return self._requeue()
        return None

    def _log(self, a: sm.Log) -> None:
        msg, fields = a.message, dict(a.fields)
        if "seconds_left" in fields:
            dl = utcnow() + dt.timedelta(seconds=float(fields["seconds_left"]))
            fields["deadline_utc"] = dl.isoformat(timespec="seconds").replace("+00:00", "Z")
            msg += f", deadline {dl:%H:%M:%S}Z"
        if a.kind == "notice" and self._delivered is not None:
            fields["signalled_pids"], self._delivered = self._delivered, None
            msg += f", {self.notice_sig.name} to {len(fields['signalled_pids'])} process(es)"
        self.say(msg)
        step = fields.pop("step", None)
        seconds = fields.pop("seconds", None)
        self.events.append(a.kind, step=step, seconds=seconds, message=msg, **fields)

    def _preflight(self) -> sm.Event:
        from ckrun.supervisor.preflight import preflight

        rep = preflight(self.cfg, self.rundir, self.storage)
        for w in rep.warnings:
            self.say("warning: " + w)
        return rep.event(time.monotonic())

    def _child_env(self, attempt: int, resume_step: int | None) -> dict[str, str]:
        cfg = self.cfg
        env = dict(os.environ)
        env.pop("CKRUN_RESUME_STEP", None)
        root = cfg.run_root
        if is_local_storage(root):
            root = os.path.abspath(root.removeprefix("file://"))
        env.update(
            CKRUN_RUN=cfg.run,
            CKRUN_ATTEMPT=str(attempt),
            CKRUN_STORAGE=root,
            CKRUN_CONTROL_DIR=self.rundir.control_dir,
            CKRUN_GRACE_S=f"{cfg.grace_s:g}",
            CKRUN_NOTICE_SIGNAL=self.notice_sig.name,
            CKRUN_CONFIG_HASH=cfg.launch_hash(),
            CKRUN_ALLOW_CHANGE=",".join(cfg.allow_change),
        )
        env.update(storage_env(cfg))  # endpoint_url, s3_* from the profile
        if resume_step is not None:
            env["CKRUN_RESUME_STEP"] = str(resume_step)
        return env

    def _spawn(self, a: sm.Spawn) -> sm.Event | None:
        control.clear(self.rundir.control_dir)
        self.events.attempt = a.attempt
        if self.lock is not None:
            self.lock.update(attempt=a.attempt)
        try:
            self.child = process.spawn(
                self._command(),
                self._child_env(a.attempt, a.resume_step),
                track_tree=self.cfg.nproc_per_node * self.cfg.nnodes > 1,
            )
        except (OSError, CkrunError) as e:
            return sm.SpawnFailed(str(e), time.monotonic())
        for src in self.sources:
            hook = getattr(src, "attempt_started", None)
            if hook is not None:
                hook(control_dir=self.rundir.control_dir)
        self.events.append("spawn", pid=self.child.pid, command=list(self.cfg.command))
        return None

    def _command(self) -> tuple[str, ...]:
        """The command to spawn: under torchrun with ``nproc_per_node``/``nnodes`` > 1
        (:func:`ckrun.supervisor.torchrun.wrap`)."""
        from ckrun.supervisor import torchrun

        cfg = self.cfg
        return torchrun.wrap(
            cfg.command,
            nproc_per_node=cfg.nproc_per_node,
            nnodes=cfg.nnodes,
            node_rank=self.job.rank if self.job else 0,
            grace_s=cfg.grace_s,
        )

    def _requeue(self) -> sm.Event:
        now = time.monotonic()
        if self.job is None:
            return sm.Requeued(sm.RequeueResult.FAILED, "not inside a job of this scheduler", now)
        try:
            out = self.scheduler.requeue(self.job)
        except CkrunError as e:
            return sm.Requeued(sm.RequeueResult.FAILED, str(e), now)
        restart = out == RequeueOutcome.RESTART_HERE
        return sm.Requeued(
            sm.RequeueResult.RESTART_HERE if restart else sm.RequeueResult.REQUEUED, "", now
        )

    def _prior_attempts(self) -> int:
        """Attempts already made in this run (events and manifests), so ids never repeat."""
        from ckrun.runlog import read_events
        from ckrun.supervisor.preflight import newest_attempt

        seen = [
            int(e.get("attempt", 0)) + 1
            for e in read_events(self.rundir.events_path)
            if e.get("kind") == "spawn"
        ]
        last = newest_attempt(self.storage)
        return max([0, *seen, (last + 1) if last is not None else 0])

    def _abandon(self) -> None:
        """On an unexpected exit of the loop, do not leave the child running."""
        c = self.child
        if c is not None and c.status is None and self.state.exit_code is None:
            process.signal_session(c, signal.SIGKILL)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and c.pid not in process.reap():
                time.sleep(0.01)
