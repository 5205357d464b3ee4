"""The run's budgets, persisted with the run so every start continues the count.

A requeued Slurm job, a new Kubernetes pod or a new spot VM starts a fresh supervisor;
the preemptions, failures, failures without progress (crash-loop guard) and
preemptions in a row without a new checkpoint (requeue-storm guard) must continue from
where the last supervisor left them, or a child that dies at every start is retried
forever.  The supervisor reads a :class:`RunBudgets` record at start and writes it on
every change (the machine's :class:`ckrun.supervisor.messages.Persist` action).

The record lives behind :class:`BudgetStore`; :class:`RunDirBudgets` keeps it in the run's
state directory next to ``events.jsonl`` (``budgets.json``).  ``ckrun submit`` starts a
new submission with fresh budgets (:meth:`BudgetStore.reset`); ``ckrun run`` continues.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Protocol

from ckrun.storage.fsutil import write_json_atomic
from ckrun.supervisor.state import Policy, State

BUDGETS_FILE = "budgets.json"


@dataclass(frozen=True)
class RunBudgets:
    """Counts of one submission of a run.

    Attributes:
        preemptions: preemptions so far (against ``max_requeues``).
        failures: failures of the command (against ``max_failures``).
        no_progress: failures in a row without checkpoint progress.
        streak: preemptions in a row without a new checkpoint.
    """

    preemptions: int = 0
    failures: int = 0
    no_progress: int = 0
    streak: int = 0


class BudgetStore(Protocol):
    """Where a run's :class:`RunBudgets` live."""

    def load(self) -> RunBudgets:
        """The stored budgets; zeros when there are none (or they are unreadable)."""
        ...

    def save(self, budgets: RunBudgets) -> None:
        """Store ``budgets`` durably.

        Raises:
            OSError: the store cannot be written.
        """
        ...

    def reset(self) -> None:
        """Start over at zero (a new submission)."""
        ...


class RunDirBudgets:
    """``<state root>/budgets.json`` (written atomically and fsynced).

    Args:
        root: the run's state directory (:attr:`ckrun.supervisor.rundir.RunDir.root`).
    """

    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, BUDGETS_FILE)

    def load(self) -> RunBudgets:
        """The stored budgets, or zeros."""
        try:
            with open(self.path, encoding="utf-8") as f:
                body = json.load(f)
            return RunBudgets(**{k: int(body.get(k, 0)) for k in asdict(RunBudgets())})
        except (OSError, ValueError, TypeError, AttributeError):
            return RunBudgets()

    def save(self, budgets: RunBudgets) -> None:
        """Write the record atomically."""
        write_json_atomic(self.path, asdict(budgets))

    def reset(self) -> None:
        """Start over: a record of zeros (newer than the run's record in storage, so the
        next supervisor here starts the new submission at zero)."""
        self.save(RunBudgets())


def budgets_of(s: State) -> RunBudgets:
    """The budgets the machine's state ``s`` holds (what a :class:`Persist` writes)."""
    return RunBudgets(s.preemptions, s.failures, s.no_progress, s.streak)


def resumed_state(policy: Policy, attempt: int, b: RunBudgets) -> State:
    """The machine's state at a supervisor's start: ``attempt`` attempts already started
    (ids never repeat within a run) and the budgets ``b`` read back."""
    return State(
        policy=policy,
        attempt=attempt,
        preemptions=b.preemptions,
        failures=b.failures,
        no_progress=b.no_progress,
        streak=b.streak,
    )
