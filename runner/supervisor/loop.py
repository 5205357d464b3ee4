"""The supervisor loop: executes :mod:`ckrun.supervisor.machine`'s actions on real processes.

The pure ``step(state, event) -> (state, actions)`` (DESIGN.md §4.5) lives in
:mod:`ckrun.supervisor.machine` (events and actions in :mod:`ckrun.supervisor.messages`) and is
re-exported here.

One thread, ticking every ``tick_s`` (0.2 s) or sooner when a signal arrives (the
handlers only record it, :mod:`ckrun.supervisor.signals`).  Each round it

1. takes in signals, ``ckrun preempt``/``cancel`` requests, a peer notice and the notice
   sources' notices as the machine's events (:mod:`ckrun.supervisor.intake`);
2. reaps (it alone waits: orphans adopted in subreaper mode are reaped too); while the
   command's own process is gone but its session is not, it feeds ``LeaderExited`` (the
   machine's stray timers decide TERM/KILL); the attempt ends when the session is empty
   (:mod:`ckrun.supervisor.attempt`: the newest commit in storage and the library's
   exit-reason record, not the child's word).  A peer notice left before the child's end
   is taken first, so the exit is judged as a drain's;
3. in own-checkpoint mode commits a new version of the script's files
   (:mod:`ckrun.supervisor.own_checkpoint`);
4. feeds a ``Tick`` (every timer is the machine's state).

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
from functools import partial
from signal import Signals
from typing import IO, Any

from ckrun.config import RunConfig
from ckrun.control_files import clear as clear_control
from ckrun.control_files import reserve_exit_reason, write_escalation, write_notice
from ckrun.errors import CkrunError
from ckrun.notices import Notice, NoticeSource, utcnow
from ckrun.runlog import EventLog
from ckrun.scheduler.base import JobInfo, Scheduler
from ckrun.storage.base import Storage
from ckrun.supervisor import attempt, launch, own_checkpoint, process
from ckrun.supervisor import machine as sm
from ckrun.supervisor.budgets import BudgetStore, RunDirBudgets, budgets_of, resumed_state
from ckrun.supervisor.child import AttemptChild
from ckrun.supervisor.console import Console
from ckrun.supervisor.intake import NoticeIntake
from ckrun.supervisor.machine import Phase, Policy, State, step
from ckrun.supervisor.ownership import Ownership
from ckrun.supervisor.ports import Clock, MonotonicClock, OsProcessTable, ProcessTable
from ckrun.supervisor.rundir import CANCEL_REQUEST, PREEMPT_REQUEST, RunDir, SupervisorLock
from ckrun.supervisor.runstate import MirroredEventLog, RunState, StorageBudgets
from ckrun.supervisor.signals import SignalInbox
from ckrun.supervisor.state import policy_of
from ckrun.supervisor.watched import WatchedFiles, mark_started

__all__ = ["Phase", "Policy", "State", "Supervisor", "policy_of", "step"]


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
        self.kid = AttemptChild(self.procs, self.clock)
        self._storage: Storage | None = None
        self.inbox = SignalInbox(self.notice_sig)
        self.intake = NoticeIntake(
            cfg, job, rundir, sources, self.notice_sig, self.say, self._append
        )
        self._queue: collections.deque[sm.Event] = collections.deque()
        self._watched: WatchedFiles | None = None
        self.state = sm.State(policy=policy_of(cfg))
        self._numbered = False  # the attempt number is known (the run's record is read)
        self.owner: Ownership | None = None
        self.runstate: RunState | None = None
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
            self._watched = own_checkpoint.watched_files(self.cfg, self.storage)
        return self._watched

    def say(self, message: str) -> None:
        """Print one ``[ckrun]`` line."""
        # before the run's record is read (the lease comes first) no attempt number is known
        who = f"{self.cfg.run} attempt {self.events.attempt}" if self._numbered else self.cfg.run
        line = f"[ckrun] {who}: {message}"
        print(line, file=self.out, flush=True)
        lost = self.out.lost
        if lost is not None and not self._console_noted:  # once: the run goes on
            self._console_noted = True
            self.events.append("console_lost", message=f"console gone ({lost}); at: {message}")

    def _append(self, kind: str, **fields: Any) -> None:
        self.events.append(kind, **fields)

    def signal(self, signum: int) -> None:
        """Record signal ``signum`` (the handler; tests call it directly)."""
        self.inbox.record(signum)

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
        restore = self.inbox.install(restore_signals=self.restore_signals)
        try:
            return self._run()
        finally:
            restore()

    def _run(self) -> int:
        subreaper = self.procs.become_subreaper()
        for stale in (PREEMPT_REQUEST, CANCEL_REQUEST):  # left by a dead supervisor
            self.rundir.take_request(stale)
        b = self.budgets.load()
        started = launch.prior_attempts(self.rundir, self.storage)
        if self.runstate is not None:  # the run's record in storage may know more
            started = max(started, self.runstate.record.attempts)
        self.state = resumed_state(self.state.policy, started, b)
        self.events.attempt = self.state.attempt
        self._numbered = True
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
            preflighted = self._preflight()
            # a notice held while the supervisor started, or sent during preflight, comes
            # before the start decision: the machine does not start the command
            now = self.clock.monotonic()
            self._queue.extend(self.intake.from_signals(self.inbox.take(), now, self.kid.resize))
            self._queue.append(preflighted)
            while True:
                while self._queue:
                    self._feed(self._queue.popleft())
                if self.state.terminal:
                    break
                self._round()
        finally:
            if self.state.exit_code is None:  # an unexpected exit: do not leave it running
                self.kid.abandon(self.inbox.wake_fd)
            self.intake.close()
        code = int(self.state.exit_code or 0)
        self.events.append("supervisor_exit", exit_code=code, state=self.state.phase.value)
        return code

    def _round(self) -> None:
        self.clock.wait(self.inbox.wake_fd, self.tick_s)
        now = self.clock.monotonic()
        intake, queue = self.intake, self._queue
        queue.extend(intake.from_signals(self.inbox.take(), now, self.kid.resize))
        queue.extend(intake.requests(now))
        queue.extend(intake.peer_notice(now))
        queue.extend(intake.poll(now))
        self._reap(now)
        if self.owner is not None and self.owner.lost is not None and not intake.lost_sent:
            queue.append(intake.lease_lost(self.owner.lost, now))
        w, c = self.watched, self.kid.current
        if w is not None and c is not None and c.status is None:  # own-checkpoint mode
            members = self.procs.members(c)
            if own_checkpoint.commit_new_version(w, members, self.say, self._append):
                queue.append(intake.drill("check-resume", now))
        queue.append(sm.Tick(self.clock.monotonic()))

    def _feed(self, ev: sm.Event) -> None:
        self.state, actions = sm.step(self.state, ev)
        for a in actions:
            follow = self._execute(a)
            if follow is not None:
                self._queue.append(follow)

    # ------------------------------------------------------------ child
    def _reap(self, now: float) -> None:
        c = self.kid.reap(now)
        if isinstance(c, sm.LeaderExited):
            self._queue.append(c)
        if not isinstance(c, process.Child) or c.status is None:
            return
        self._queue.extend(self.intake.peer_notice(now))  # judged before the end
        if self.watched is not None:
            own_checkpoint.commit_after_exit(self.watched, c.status, self.state.notice_at, self.say)
        end = attempt.attempt_end(
            c, c.status, self.storage, self.rundir, self.events, now, self.clock.monotonic
        )
        self._queue.append(end)

    # ------------------------------------------------------------ actions
    def _execute(self, a: sm.Action) -> sm.Event | None:
        kid = self.kid
        if isinstance(a, sm.Log):
            self._log(a)
        elif isinstance(a, sm.RunPreflight):
            return self._preflight()
        elif isinstance(a, sm.Spawn):
            return self._spawn(a)
        elif isinstance(a, sm.WriteNotice):
            n = self.intake.last_notice
            detail = dict(n.detail) if n is not None and n.source == a.source else {}
            notice = Notice.with_lead(a.kind, a.source, a.seconds_left, detail)
            self._try("write notice.json", write_notice, self.rundir.control_dir, notice)
        elif isinstance(a, sm.Deliver):
            count = kid.deliver(self._notice_sig(), to_script=self.watched is not None)
            return None if count is None else sm.Delivered(count, self.clock.monotonic())
        elif isinstance(a, sm.SignalGroup):
            kid.signal(a.sig)
        elif isinstance(a, sm.Escalate) and kid.current is not None:
            self._try("write the escalation mark", write_escalation, self.rundir.control_dir)
            kid.escalate()
        elif isinstance(a, sm.Kill):
            kid.signal(signal.SIGKILL)
        elif isinstance(a, sm.Persist):
            self._persist()
        elif isinstance(a, sm.Requeue):
            return attempt.requeue(self.scheduler, self.job, self.clock.monotonic())
        return None

    def _persist(self) -> None:
        try:
            self.budgets.save(budgets_of(self.state))
        except OSError as e:  # full disk: keep supervising; the count stays in memory
            self.say(f"warning: cannot record the run's budgets ({e}); continuing")

    def _log(self, a: sm.Log) -> None:
        msg, fields = a.message, dict(a.fields)
        if "seconds_left" in fields:
            dl = utcnow() + dt.timedelta(seconds=float(fields["seconds_left"]))
            fields["deadline_utc"] = dl.isoformat(timespec="seconds").replace("+00:00", "Z")
            msg += f", deadline {dl:%H:%M:%S}Z"
        msg = self.kid.annotate(a.kind, msg, fields, self._notice_sig().name)
        self.say(msg)
        step = fields.pop("step", None)
        seconds = fields.pop("seconds", None)
        self.events.append(a.kind, step=step, seconds=seconds, message=msg, **fields)

    def _notice_sig(self) -> Signals:
        """The signal the child gets as the notice (an own-checkpoint script's own)."""
        return self.notice_sig if self.watched is None else self.cfg.child_signal_number()

    def _preflight(self) -> sm.Event:
        from ckrun.supervisor.preflight import preflight

        if self.owner is not None:
            lost = self.owner.check()  # renew now: never start a child without the lease
            if lost is not None:
                return self.intake.lease_lost(lost, self.clock.monotonic())
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
        epoch = self.owner.epoch if self.owner is not None else None
        if self.runstate is not None:
            self.runstate.update(attempts=attempt + 1)
        return launch.child_env(self.cfg, self.rundir, attempt, resume_step, epoch)

    def _spawn(self, a: sm.Spawn) -> sm.Event | None:
        self._try("clear control/", clear_control, self.rundir.control_dir)
        reserve_exit_reason(self.rundir.control_dir)
        self.events.attempt = a.attempt
        if self.lock is not None:
            self._try("update the lock holder", partial(self.lock.update, attempt=a.attempt))
        try:
            command = own_checkpoint.restore_command(
                self.watched,
                a.attempt,
                launch.command(self.cfg, self.job),
                self.cfg.resume_args,
                self.say,
            )
            child = self.kid.start(
                command,
                self._child_env(a.attempt, a.resume_step),
                track_tree=self.cfg.nproc_per_node * self.cfg.nnodes > 1,
            )
        except (OSError, CkrunError) as e:
            return sm.SpawnFailed(str(e), self.clock.monotonic())
        self.intake.attempt_started()
        self.events.append("spawn", pid=child.pid, command=list(self.cfg.command))
        if self.watched is not None:  # an unmodified script never reports its first step:
            mark_started(self.rundir.control_dir, child.pid)  # training counts from spawn
        return None
