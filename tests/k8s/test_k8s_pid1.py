"""ckrun as PID 1 of a new PID namespace: what a container runtime does to a pod.

No Kubernetes can run here.  The container is emulated with ``unshare --pid --fork
--mount-proc`` (needs root): ``ckrun run`` is exec'd as the namespace's PID 1, exactly
like the rendered Job's exec-form ``command``; the environment is the one the rendered
Job gives a pod (``KUBERNETES_SERVICE_HOST``, the Downward API ``CKRUN_K8S_*``), so the
supervisor picks the k8s backend.  The kubelet's part is played by the test: SIGTERM to
PID 1 from the parent namespace, a deadline of ``terminationGracePeriodSeconds``; the Job
controller's part (a new pod after exit 75, the ignored-failure-count annotation) too.
Real processes, real signals, real files on disk; nothing is mocked.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "pid1_train.py"
CKRUN = Path(sys.executable).with_name("ckrun")
GRACE_S = 20  # terminationGracePeriodSeconds of the emulated pod
MARGIN_S = 12  # grace_margin_s: > the supervisor's kill_delay_s (10 s) + margin_s (2 s)


def rendered_env(run: str) -> dict[str, str]:
    """The literal env of the Job ckrun renders for this pod (Downward API ones skipped)."""
    from ckrun.scheduler.base import JobSpec
    from ckrun.scheduler.k8s import K8sScheduler, Options

    spec = JobSpec(
        run=run,
        command=("python", "t.py"),
        storage="pvc:ckpt",
        options=Options(image="i", termination_grace_period_s=GRACE_S, grace_margin_s=MARGIN_S),
    )
    (c,) = K8sScheduler().manifest(spec)["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in c["env"] if "value" in e}


def _unshare_works() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare") or not CKRUN.exists():
        return False
    r = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30
    )
    return r.returncode == 0


pytestmark = pytest.mark.skipif(
    not _unshare_works(), reason="needs root and a working `unshare --pid --mount-proc`"
)


def _poll(cond: Callable[[], object], timeout_s: float, what: str) -> object:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, ppid) of host pid ``pid``, or None once it is gone (reaped)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except (FileNotFoundError, ProcessLookupError):
        return []


def _children(ppid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and st[1] == ppid:
                out.append(int(entry))
    return out


class Pod:
    """``ckrun run`` as PID 1 of a new PID namespace, with a pod's environment."""

    def __init__(
        self,
        tmp: Path,
        run: str,
        train_args: list[str],
        *,
        attempt: int = 0,
        shell: bool = False,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.storage = tmp / "storage"
        self.log = tmp / f"pod-{attempt}.log"
        cmd = [sys.executable, str(TRAIN), *train_args]
        if shell:  # `sh -c` style: sh stays the trainer's parent and passes the status on
            cmd = ["sh", "-c", 'python "$0" "$@"; exit $?', *cmd[1:]]
        argv = [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            "--kill-child",
            str(CKRUN),
            "run",
            "--run",
            run,
            "--storage",
            str(self.storage),
            "--",
            *cmd,
        ]
        env = dict(
            os.environ,
            PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
            KUBERNETES_SERVICE_HOST="10.96.0.1",
            HOSTNAME=f"{run}-0",
            JOB_COMPLETION_INDEX="0",
            CKRUN_K8S_JOB_NAME=run,
            CKRUN_K8S_NAMESPACE="default",
            CKRUN_K8S_POD_NAME=f"{run}-0-abcde",
            CKRUN_K8S_FAILURE_COUNT="",
            CKRUN_K8S_IGNORED_FAILURE_COUNT=str(attempt) if attempt else "",
            **rendered_env(run),
            **(extra_env or {}),
        )
        for key in ("SLURM_JOB_ID", "CKRUN_STATE_DIR", "CKRUN_STORAGE_BASE"):
            env.pop(key, None)
        self.out = open(self.log, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            argv, stdout=self.out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.init = int(_poll(self._init_pid, 30, "the namespace's PID 1"))  # type: ignore[arg-type]

    def _init_pid(self) -> int | None:
        kids = _children(self.proc.pid)
        return kids[0] if kids else None

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout_s: float = 60) -> re.Match[str]:
        return _poll(
            lambda: re.search(pattern, self.text()),
            timeout_s,  # type: ignore[return-value]
            f"{pattern!r} in {self.log}",
        )

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.out.close()


@pytest.fixture
def pods() -> Iterator[list[Pod]]:
    started: list[Pod] = []
    yield started
    for pod in started:
        pod.close()


def _commits(storage: Path, run: str) -> list[int]:
    return sorted(
        int(p.parent.name.split("-")[1])
        for p in (storage / run / "checkpoints").glob("step-*/manifest.json")
    )


def test_pod_env_is_the_rendered_one() -> None:
    assert rendered_env("x") == {
        "CKRUN_K8S_TERMINATION_GRACE_S": str(GRACE_S),
        "CKRUN_GRACE_S": str(GRACE_S - MARGIN_S),
    }


def test_ckrun_is_pid_1(tmp_path: Path, pods: list[Pod]) -> None:
    pod = Pod(tmp_path, "pid1", ["--steps", "3", "--step-s", "0.01"])
    pods.append(pod)
    status = Path(f"/proc/{pod.init}/status").read_text()
    nspid = re.search(r"^NSpid:\s+(.*)$", status, re.M)
    assert nspid is not None and nspid.group(1).split()[-1] == "1"
    assert "ckrun" in " ".join(_cmdline(pod.init))
    assert pod.wait(120) == 0, pod.text()
    assert (pod.storage / "pid1" / "COMPLETE.json").exists()


def test_sigterm_checkpoints_and_exits_75_within_the_grace(tmp_path: Path, pods: list[Pod]) -> None:
    pod = Pod(tmp_path, "term", [])
    pods.append(pod)
    pod.wait_for(r"step 5\b")
    t0 = time.monotonic()
    os.kill(pod.init, signal.SIGTERM)  # the kubelet, from outside the namespace
    rc = pod.wait(GRACE_S)
    elapsed = time.monotonic() - t0
    assert rc == 75, pod.text()
    assert elapsed < GRACE_S
    saved = int(pod.wait_for(r"saved (\d+) on notice").group(1))
    assert _commits(pod.storage, "term") == [saved]


def test_adopted_orphans_are_reaped(tmp_path: Path, pods: list[Pod]) -> None:
    """Daemonized grandchildren are re-parented to PID 1 (ckrun); their zombies vanish."""
    # they sleep 60 s: seen adopted whatever the machine's speed, then ended by the test
    pod = Pod(tmp_path, "orph", ["--orphans", "3", "--orphan-s", "60"])
    pods.append(pod)

    def adopted() -> list[int]:
        return [p for p in _children(pod.init) if _cmdline(p)[:1] == ["ckrun-test-orphan"]]

    orphans = _poll(lambda: len(adopted()) == 3 and adopted(), 60, "3 adopted orphans")
    assert isinstance(orphans, list)
    for p in orphans:
        os.kill(p, signal.SIGTERM)
    # a PID 1 that never waits would leave them as 'Z'
    _poll(lambda: all(_stat(p) is None for p in orphans), 20, "the orphans to be reaped")
    zombies = [p for p in _children(pod.init) if (_stat(p) or ("", 0))[0] == "Z"]
    assert zombies == []
    os.kill(pod.init, signal.SIGTERM)
    assert pod.wait(GRACE_S) == 75, pod.text()


def test_sh_c_command_still_checkpoints(tmp_path: Path, pods: list[Pod]) -> None:
    pod = Pod(tmp_path, "shc", [], shell=True)
    pods.append(pod)
    pod.wait_for(r"step 5\b")
    os.kill(pod.init, signal.SIGTERM)
    assert pod.wait(GRACE_S) == 75, pod.text()
    saved = int(pod.wait_for(r"saved (\d+) on notice").group(1))
    assert _commits(pod.storage, "shc") == [saved]


@pytest.mark.slow
def test_requeue_cycle_resumes_in_a_new_pod(tmp_path: Path, pods: list[Pod]) -> None:
    """Pod 0 is drained (exit 75); the Job controller's replacement resumes and completes."""
    first = Pod(tmp_path, "cycle", ["--steps", "60"])
    pods.append(first)
    first.wait_for(r"step 10\b")
    os.kill(first.init, signal.SIGTERM)
    assert first.wait(GRACE_S) == 75, first.text()
    saved = int(first.wait_for(r"saved (\d+) on notice").group(1))
    second = Pod(tmp_path, "cycle", ["--steps", "60"], attempt=1)
    pods.append(second)
    assert second.wait(120) == 0, second.text()
    assert re.search(rf"resumed {saved}\b", second.text()), second.text()
    assert (second.storage / "cycle" / "COMPLETE.json").exists()


@pytest.mark.slow
def test_a_trainer_that_ignores_the_notice_is_stopped_before_sigkill(
    tmp_path: Path, pods: list[Pod]
) -> None:
    """No save: TERM kill_delay_s before KILL, KILL margin_s before the deadline (issue 11
    item 4: both inside ckrun's grace), exit 76 before terminationGracePeriodSeconds."""
    from ckrun.supervisor.state import Policy

    term_at, _ = Policy(grace_s=GRACE_S - MARGIN_S).escalation(0.0, GRACE_S - MARGIN_S)
    pod = Pod(tmp_path, "deaf", ["--ignore-notice"])
    pods.append(pod)
    pod.wait_for(r"step 5\b")
    t0 = time.monotonic()
    os.kill(pod.init, signal.SIGTERM)
    rc = pod.wait(GRACE_S + 10)
    elapsed = time.monotonic() - t0
    assert rc == 76, pod.text()
    assert term_at - 0.5 < elapsed < GRACE_S, elapsed
    assert _commits(pod.storage, "deaf") == []


def test_config_error_exits_3_for_failjob(tmp_path: Path, pods: list[Pod]) -> None:
    """podFailurePolicy's FailJob rule matches exit 3: a bad value in the pod's env."""
    pod = Pod(tmp_path, "badcfg", [], extra_env={"CKRUN_MAX_FAILURES": "many"})
    pods.append(pod)
    assert pod.wait(60) == 3, pod.text()
    assert "max_failures" in pod.text()


@pytest.mark.slow
def test_incompatible_checkpoint_exits_4_for_failjob(tmp_path: Path, pods: list[Pod]) -> None:
    """A replacement pod launched with another command refuses the run's checkpoint: 4."""
    first = Pod(tmp_path, "compat", ["--steps", "500"])
    pods.append(first)
    first.wait_for(r"step 3\b")
    os.kill(first.init, signal.SIGTERM)
    assert first.wait(GRACE_S) == 75, first.text()
    second = Pod(tmp_path, "compat", ["--steps", "501"], attempt=1)
    pods.append(second)
    assert second.wait(60) == 4, second.text()
