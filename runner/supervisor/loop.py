"""The supervisor loop: executes :mod:`ckrun.supervisor.machine`'s actions on real processes.

The pure ``step(state, event) -> (state, actions)`` (DESIGN.md §4.5) lives in
:mod:`ckrun.supervisor.machine` (events and actions in :mod:`ckrun.supervisor.messages`) and is
re-exported here.

One thread, ticking every ``tick_s`` (0.2 s) or sooner when a signal arrives (the
handlers only record the signal number; ``signal.set_wakeup_fd`` wakes the ``select``).
Each round it

1. drains the recorded signals: SIGTERM and the notice signal (default USR1) become
   notices, SIGINT (Ctrl-C) a save-and-stop :class:`~ckrun.supervisor.messages.Interrupt`,
   HUP/QUIT are forwarded to the child's group, USR2 and CHLD only wake;
2. takes ``ckrun preempt`` / ``ckrun cancel`` requests from ``control/``, and a peer
   notice (``peer-notice.json``: the child's ranks agreed to stop for a notice that
   reached another node of a multi-node job, :func:`ckrun.control.write_peer_notice`),
   which drains this node like a notice of its own, without a restart in place;
3. polls the notice sources (scheduler's, cloud, chaos);
4. reaps (it alone waits: orphans adopted in subreaper mode are reaped too); while the
   command's own process is gone but its session is not, it feeds ``LeaderExited`` (the
   machine's stray timers decide TERM/KILL); the attempt ends when the session is empty,
   then the newest commit in storage and the library's exit-reason record are read (the
   supervisor checks the checkpoint itself, not the child's word).  A peer notice left
   before the child's end is taken first, so the exit is judged as a drain's;
5. feeds a ``Tick`` (every timer is the machine's state).

The clock and the process table are arguments (:mod:`ckrun.supervisor.ports`), so the
loop runs in tests with a fake clock and fake processes.  The signal handlers stay
installed until the process exits (a notice signal after the end, e.g. Slurm's
time-limit USR1 just after completion, is ignored instead of killing the supervisor).
The run's budgets are read at start and written on each change
(:mod:`ckrun.supervisor.budgets`); the owner keeps them, its attempts and its events in
the run's storage (:mod:`ckrun.supervisor.runstate`), so a fresh machine continues them.

Ownership (DESIGN.md §7): before anything else the supervisor acquires the run's lease
(:mod:`ckrun.supervisor.ownership`; another live owner → wait or exit 2), gives the
child its epoch (``CKRUN_LEASE_EPOCH``, fencing its commits), renews it from a heartbeat
thread, checks it before every preflight, and releases it on exit.  A lost lease becomes
a ``lease_lost`` notice: the child is told and drained, then exit 2, no requeue.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import os
import signal
import sys
from collections.abc import Callable
from typing import IO, Any

from ckrun import control
from ckrun.config import RunConfig
from ckrun.errors import CkrunError
from ckrun.notices import DRILL, PREEMPTION, TERMINATION, TIME_LIMIT, Notice, NoticeSource, utcnow
from ckrun.runlog import EventLog
from ckrun.scheduler.base import JobInfo, RequeueOutcome, Scheduler
from ckrun.storage.base import Storage
from ckrun.supervisor import launch, process
from ckrun.supervisor import machine as sm
from ckrun.supervisor.budgets import BudgetStore, RunBudgets, RunDirBudgets
from ckrun.supervisor.console import Console
from ckrun.supervisor.machine import Phase, Policy, State, step
from ckrun.supervisor.ownership import Ownership
from ckrun.supervisor.ports import Clock, MonotonicClock, OsProcessTable, ProcessTable
from ckrun.supervisor.rundir import CANCEL_REQUEST, PREEMPT_REQUEST, RunDir, SupervisorLock
from ckrun.supervisor.runstate import MirroredEventLog, RunState, StorageBudgets
from ckrun.supervisor.watched import WatchedFiles, deliver_to_script, mark_started

__all__ = ["Phase", "Policy", "State", "Supervisor", "policy_of", "step"]

_FORWARD = (signal.SIGHUP, signal.SIGQUIT)


def policy_of(cfg: RunConfig) -> Policy:
    """The machine's :class:`Policy` from a run's config."""
    return Policy(
        max_requeues=cfg.max_requeues,
        max_failures=cfg.max_failures,
        crash_loop_failures=cfg.crash_loop_failures,
        grace_s=cfg.grace_s,
        margin_s=cfg.margin_s,
        kill_delay_s=cfg.kill_delay_s,
        backoff_s=cfg.backoff_s,
        backoff_max_s=cfg.backoff_max_s,
        stray_s=cfg.stray_s,
        no_progress_preemptions=cfg.no_progress_preemptions,
    )


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
        clock: time and waiting (default: the monotonic clock).
        procs: the process table (default: real processes).
        budgets: where the run's budgets live (default: ``budgets.json`` in ``rundir``).
        restore_signals: restore the previous signal handlers when :meth:`run` returns
            (in-process use); by default they stay (ignoring) until the process exits.
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
        clock: Clock | None = None,
        procs: ProcessTable | None = None,
        budgets: BudgetStore | None = None,
        restore_signals: bool = False,
    ) -> None:
        self.cfg, self.rundir, self.scheduler, self.job = cfg, rundir, scheduler, job
        self.sources, self.lock, self.tick_s = sources, lock, tick_s
        self.clock: Clock = clock or MonotonicClock()
        self.procs: ProcessTable = procs or OsProcessTable()
        self.budgets: BudgetStore = budgets or RunDirBudgets(rundir.root)
        self._own_budgets = budgets is None
        self.restore_signals = restore_signals
        self.out = Console(out or sys.stderr)
        self.notice_sig = cfg.signal_number()
        self.events = EventLog(rundir.events_path, cfg.run, fallback=self.out)
        self.child: process.Child | None = None
        self._storage: Storage | None = None
        self._signals: collections.deque[int] = collections.deque()
        self._queue: collections.deque[sm.Event] = collections.deque()
        self._last_notice: Notice | None = None
        self._delivered: list[int] | None = None
        self._notified: set[int] = set()
        self._watched: WatchedFiles | None = None
        self._wake_r = -1
        self.state = sm.State(policy=policy_of(cfg))
        self.owner: Ownership | None = None
        self.runstate: RunState | None = None
        self._lost_sent = False
        self._console_noted = False

    # ------------------------------------------------------------ plumbing
    @property
    def storage(self) -> Storage:
        """The run root's storage (opened on first use)."""
        if self._storage is None:
            from ckrun.supervisor.preflight import open_run_storage

            self._storage = open_run_storage(self.cfg)
        return self._storage

    @property
    def watched(self) -> WatchedFiles | None:
        """Own-checkpoint mode's commit source (None without ``checkpoint_paths``)."""
        if self._watched is None and self.cfg.checkpoint_paths:
            self._watched = WatchedFiles(
                tuple(self.cfg.checkpoint_paths),
                self.storage,
                self.cfg.run,
                compat={"launch_hash": self.cfg.launch_hash()},
            )
        return self._watched

    def say(self, message: str) -> None:
        """Print one ``[ckrun]`` line."""
        line = f"[ckrun] {self.cfg.run} attempt {self.events.attempt}: {message}"
        print(line, file=self.out, flush=True)
        lost = self.out.lost
        if lost is not None and not self._console_noted:  # once: the run goes on
            self._console_noted = True
            self.events.append("console_lost", message=f"console gone ({lost}); at: {message}")

    def signal(self, signum: int) -> None:
        """Record signal ``signum`` (the handler; tests call it directly)."""
        self._signals.append(signum)

    def _handler(self, signum: int, frame: object) -> None:
        self._signals.append(signum)

    def _install(self) -> Callable[[], None]:
        sigs = {signal.SIGTERM, self.notice_sig, signal.SIGUSR2, signal.SIGCHLD, signal.SIGINT}
        sigs.update(_FORWARD)
        old = {s: signal.signal(s, self._handler) for s in sigs}
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._wake_r = r

        def restore() -> None:
            signal.set_wakeup_fd(old_fd)
            for s, h in old.items():
                if self.restore_signals or s == signal.SIGCHLD:
                    signal.signal(s, h)
                else:  # the run's outcome is decided: a late notice changes nothing
                    signal.signal(s, signal.SIG_IGN)
            os.close(r)
            os.close(w)

        return restore

    # ------------------------------------------------------------ main loop
    def run(self) -> int:
        """Run to the end; returns the exit code (DESIGN.md §3 exit codes).

        Raises:
            CkrunError: storage unusable during preflight (exit 5), and similar.
        """
        job = self.job
        self.runstate = RunState(self.storage)
        self.events = MirroredEventLog(
            self.rundir.events_path, self.cfg.run, self.runstate, fallback=self.out
        )
        if job is not None and job.rank != 0:  # the node of rank 0 owns a multi-node run
            return self._installed()
        owner = self.owner = Ownership(
            self.cfg,
            self.storage,
            job_id=job.job_id if job else None,
            attempt=launch.prior_attempts(self.rundir, self.storage),
            say=self.say,
        )
        owner.acquire()  # before preflight; LeaseHeld: exit 2 naming the holder
        try:
            self.runstate.activate(owner.epoch)
            if self._own_budgets:
                local = RunDirBudgets(self.rundir.root)
                self.budgets = StorageBudgets(self.runstate, local)  # travel with the run
            return self._installed()
        finally:
            self.runstate.flush()  # budgets and events reach storage while still owned
            owner.release()

    def _installed(self) -> int:
        restore = self._install()
        try:
            return self._run()
        finally:
            restore()

    def _run(self) -> int:
        subreaper = self.procs.become_subreaper()
        for stale in (PREEMPT_REQUEST, CANCEL_REQUEST):  # left by a dead supervisor
            self.rundir.take_request(stale)
        b = self.budgets.load()
        self.state = sm.State(
            policy=self.state.policy,
            attempt=max(
                launch.prior_attempts(self.rundir, self.storage),
                self.runstate.record.attempts if self.runstate else 0,
            ),
            preemptions=b.preemptions,
            failures=b.failures,
            no_progress=b.no_progress,
            streak=b.streak,
        )
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
            budgets=dataclasses.asdict(b),
            lease_epoch=self.owner.epoch if self.owner else None,
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
        code = int(self.state.exit_code or 0)
        self.events.append("supervisor_exit", exit_code=code, state=self.state.phase.value)
        return code

    def _round(self) -> None:
        self.clock.wait(self._wake_r, self.tick_s)
        try:
            while os.read(self._wake_r, 512):
                pass
        except BlockingIOError:
            pass
        now = self.clock.monotonic()
        while self._signals:
            self._on_signal(self._signals.popleft(), now)
        self._requests(now)
        self._peer_notice(now)
        for src in self.sources:
            n = src.poll()
            if n is not None:  # a cloud/scheduler notice means this machine goes away
                lead = getattr(src, "lead_s", None)
                self._queue.append(self._notice_event(n, now, lead, self_term=n.kind != DRILL))
        self._reap(now)
        if self.owner is not None and self.owner.lost is not None and not self._lost_sent:
            self._queue.append(self._lease_lost(self.owner.lost, now))
        self._poll_own_checkpoint(now)
        self._queue.append(sm.Tick(self.clock.monotonic()))

    def _poll_own_checkpoint(self, now: float) -> None:
        """Own-checkpoint mode: commit a finished new version of the script's files."""
        w, c = self.watched, self.child
        if w is None or c is None or c.status is not None:
            return
        try:
            step = w.poll(self.procs.members(c))
        except CkrunError as e:  # the last committed version stands; retried next round
            self.say(f"warning: own checkpoint not committed: {e}")
            return
        if step is not None:
            self.events.append("own_checkpoint", step=step, message="new version committed")
            if w.drill_due():
                n = Notice.with_lead(DRILL, "check-resume", self.cfg.grace_s)
                self._queue.append(self._notice_event(n, now))

    def _own_checkpoint_exit(self, status: int) -> None:
        """Own-checkpoint mode: commit the last trustworthy version, say what was lost."""
        w = self.watched
        assert w is not None
        try:
            w.after_exit(status, self.state.notice_at)
        except CkrunError as e:
            self.say(f"warning: own checkpoint not committed: {e}")
        lost = w.lost_report(status, self.state.notice_at)
        if lost:
            self.say(lost)

    def _lease_lost(self, why: str, now: float) -> sm.NoticeEvent:
        """The heartbeat found the lease taken over: tell the child, stop (exit 2)."""
        self._lost_sent = True
        self.say(why)
        n = Notice.with_lead(TERMINATION, "lease:lost", self.cfg.grace_s, {"reason": why})
        return self._notice_event(n, now, lease_lost=True)

    def _feed(self, ev: sm.Event) -> None:
        self.state, actions = sm.step(self.state, ev)
        for a in actions:
            follow = self._execute(a)
            if follow is not None:
                self._queue.append(follow)

    # ------------------------------------------------------------ inputs
    def _notice_event(
        self, n: Notice, now: float, window_s: float | None = None, **kw: Any
    ) -> sm.NoticeEvent:
        """The notice's deadline on the monotonic clock at detection (issue 11 item 5):
        the stated time is believed only within the provider's window
        (:func:`ckrun.notices.believed_lead`); otherwise the window from detection."""
        from ckrun.notices import believed_lead

        lead, skew = believed_lead(n, window_s)
        if skew:
            self.say(skew)
            self.events.append("notice_skew", message=skew, source=n.source)
        self._last_notice = n
        return sm.NoticeEvent(n.kind, n.source, now + lead, now, **kw)

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
        elif sig == signal.SIGINT:
            self._queue.append(sm.Interrupt(now))
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
        reaped = self.procs.reap()
        c = self.child
        if c is None:
            return
        if c.pid in reaped:
            c.status, c.exited = reaped[c.pid], now
        if c.status is None:
            self.procs.track(c, now)
            return
        left = self.procs.members(c)
        if left:
            saving = bool(self._notified & set(left))
            self._queue.append(sm.LeaderExited(c.status, now, saving))
            return
        self._peer_notice(now)  # a peer notice left before the end is judged first
        self.child = None
        from ckrun.supervisor.preflight import attempt_commits, is_complete, newest

        if self.watched is not None and c.status is not None:
            self._own_checkpoint_exit(c.status)
        step, save_s = newest(self.storage)
        why = control.read_exit_reason(self.rundir.control_dir) or {}
        self.events.append(
            "attempt_end",
            status=c.status,
            seconds=now - c.started,
            commits=attempt_commits(self.storage, self.events.attempt),
            reason=why.get("reason"),
        )
        self._queue.append(
            sm.ChildExited(
                c.status,
                step,
                is_complete(self.storage),
                self.clock.monotonic(),
                save_s,
                reason=str(why["reason"]) if why.get("reason") else None,
                detail=str(why.get("message") or ""),
            )
        )

    # ------------------------------------------------------------ actions
    def _execute(self, a: sm.Action) -> sm.Event | None:
        c = self.child
        if isinstance(a, sm.Log):
            self._log(a)
        elif isinstance(a, sm.RunPreflight):
            return self._preflight()
        elif isinstance(a, sm.Spawn):
            return self._spawn(a)
        elif isinstance(a, sm.WriteNotice):
            n = self._last_notice
            detail = dict(n.detail) if n is not None and n.source == a.source else {}
            notice = Notice.with_lead(a.kind, a.source, a.seconds_left, detail)
            self._try("write notice.json", control.write_notice, self.rundir.control_dir, notice)
        elif isinstance(a, sm.Deliver) and c is not None:
            self._delivered = (
                self.procs.deliver(c, self.notice_sig)
                if self.watched is None
                else deliver_to_script(c, self.cfg.child_signal_number())
            )
            self._notified.update(self._delivered)
            return sm.Delivered(len(self._delivered), self.clock.monotonic())
        elif isinstance(a, sm.SignalGroup) and c is not None:
            self.procs.signal_session(c, a.sig)
        elif isinstance(a, sm.Escalate) and c is not None:
            self._try(
                "write the escalation mark", control.write_escalation, self.rundir.control_dir
            )
            self.procs.signal_session(c, signal.SIGTERM)
        elif isinstance(a, sm.Kill) and c is not None:
            self.procs.signal_session(c, signal.SIGKILL)
        elif isinstance(a, sm.Persist):
            self._persist()
        elif isinstance(a, sm.Requeue):
            return self._requeue()
        return None

    def _persist(self) -> None:
        s = self.state
        b = RunBudgets(s.preemptions, s.failures, s.no_progress, s.streak)
        try:
            self.budgets.save(b)
        except OSError as e:  # full disk: keep supervising; the count stays in memory
            self.say(f"warning: cannot record the run's budgets ({e}); continuing")

    def _own_checkpoint_command(self, attempt: int, command: tuple[str, ...]) -> tuple[str, ...]:
        """Own-checkpoint mode: restore the newest verified version of the script's files
        and append the resume arguments when there was one to restore."""
        w = self.watched
        if w is None or w.restore(attempt) is None:
            return command
        self.say(f"restored {', '.join(w.paths)} (version {w.last.step if w.last else '?'})")
        return (*command, *self.cfg.resume_args)

    def _log(self, a: sm.Log) -> None:
        msg, fields = a.message, dict(a.fields)
        if "seconds_left" in fields:
            dl = utcnow() + dt.timedelta(seconds=float(fields["seconds_left"]))
            fields["deadline_utc"] = dl.isoformat(timespec="seconds").replace("+00:00", "Z")
            msg += f", deadline {dl:%H:%M:%S}Z"
        if a.kind == "notice" and self._delivered is not None:
            fields["signalled_pids"], self._delivered = self._delivered, None
            sig = self.notice_sig if self.watched is None else self.cfg.child_signal_number()
            msg += f", {sig.name} to {len(fields['signalled_pids'])} process(es)"
        self.say(msg)
        step = fields.pop("step", None)
        seconds = fields.pop("seconds", None)
        self.events.append(a.kind, step=step, seconds=seconds, message=msg, **fields)

    def _preflight(self) -> sm.Event:
        from ckrun.supervisor.preflight import preflight

        if self.owner is not None:
            lost = self.owner.check()  # renew now: never start a child without the lease
            if lost is not None:
                return self._lease_lost(lost, self.clock.monotonic())
        rep = preflight(self.cfg, self.rundir, self.storage)
        for w in rep.warnings:
            self.say("warning: " + w)
        return rep.event(self.clock.monotonic())

    def _try(self, what: str, fn: Callable[..., None], *args: Any) -> None:
        """Bookkeeping that must not crash the supervisor (full disk, read-only mount)."""
        try:
            fn(*args)
        except OSError as e:
            self.say(f"warning: cannot {what} ({e}); continuing")

    def _child_env(self, attempt: int, resume_step: int | None) -> dict[str, str]:
        env = launch.child_env(self.cfg, self.rundir, attempt, resume_step)
        env.pop("CKRUN_LEASE_EPOCH", None)
        if self.owner is not None and self.owner.epoch is not None:
            env["CKRUN_LEASE_EPOCH"] = str(self.owner.epoch)  # fences the child's commits
        if self.runstate is not None:
            self.runstate.update(attempts=attempt + 1)
        return env

    def _hold(self, attempt: int) -> None:
        if self.lock is not None:
            self.lock.update(attempt=attempt)

    def _spawn(self, a: sm.Spawn) -> sm.Event | None:
        self._try("clear control/", control.clear, self.rundir.control_dir)
        control.reserve_exit_reason(self.rundir.control_dir)
        self.events.attempt = a.attempt
        self._notified = set()
        self._try("update the lock holder", self._hold, a.attempt)
        try:
            self.child = self.procs.spawn(
                self._own_checkpoint_command(a.attempt, launch.command(self.cfg, self.job)),
                self._child_env(a.attempt, a.resume_step),
                track_tree=self.cfg.nproc_per_node * self.cfg.nnodes > 1,
            )
        except (OSError, CkrunError) as e:
            return sm.SpawnFailed(str(e), self.clock.monotonic())
        for src in self.sources:
            hook = getattr(src, "attempt_started", None)
            if hook is not None:
                hook(control_dir=self.rundir.control_dir)
        self.events.append("spawn", pid=self.child.pid, command=list(self.cfg.command))
        if self.watched is not None:  # an unmodified script never reports its first step:
            mark_started(self.rundir.control_dir, self.child.pid)  # training counts from spawn
        return None

    def _requeue(self) -> sm.Event:
        now = self.clock.monotonic()
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

    def _abandon(self) -> None:
        """On an unexpected exit of the loop, do not leave the child running."""
        c = self.child
        if c is not None and c.status is None and self.state.exit_code is None:
            self.procs.signal_session(c, signal.SIGKILL)
            deadline = self.clock.monotonic() + 5
            while self.clock.monotonic() < deadline and c.pid not in self.procs.reap():
                self.clock.wait(self._wake_r, 0.01)
