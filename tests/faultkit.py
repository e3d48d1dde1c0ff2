"""Runs a fault scenario in a fresh interpreter with a time limit and reports what happened.

The scenario is a code snippet defining ``run(report)``; it must start the
workers, call ``report.pids(...)`` with their pids, then provoke the fault.
The harness records the exception the consumer saw, the time from the fault
to the error, and whether workers or /dev/shm entries outlived the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from typing import List, Optional

from procs import own_shm_entries

# How long a fault may take to reach the consumer before the test calls it a hang. A guard, not
# a measure: the error comes within a second or two alone, and a machine loaded by other programs
# (CI runners, a second test run) may take many times that.
HANG_GUARD_S = 60.0
# After the scenario's process ended, how long its workers may take to follow it. A hang guard,
# not a measure: they die within milliseconds; a loaded machine may delay them by seconds.
LEFTOVER_WAIT_S = 5.0

_HARNESS = '''
import json, os, sys, time, traceback
class Report:
    def __init__(self):
        self.worker_pids = []
        self.t0 = None
    def pids(self, pids):
        self.worker_pids = list(pids)
    def fault_starts(self):
        self.t0 = time.monotonic()
report = Report()
{scenario}
if __name__ == "__main__":
    result = {{"type": None, "message": None}}
    try:
        run(report)
    except BaseException as exc:
        result = {{"type": type(exc).__name__, "message": str(exc),
                  "cause": str(exc.__cause__ or ""), "mro": [c.__name__ for c in type(exc).__mro__],
                  "traceback": traceback.format_exc()}}
    result["seconds"] = time.monotonic() - (report.t0 or time.monotonic())
    result["pids"] = report.worker_pids
    sys.stdout.flush()
    # One write, on a line of its own: the scenario's other processes (Ray's, workers) write to
    # the same file, and a print()'s text and newline are two writes another one can land between.
    os.write(1, ("\\nRESULT " + json.dumps(result) + "\\n").encode())
'''


@dataclass
class FaultResult:
    type: Optional[str]
    message: Optional[str]
    cause: str
    exc_types: List[str]
    seconds: float
    pids: List[int]
    stderr: str
    stdout: str
    returncode: int
    leftover_pids: List[int] = field(default_factory=list)
    new_shm: List[str] = field(default_factory=list)
    traceback: str = ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except OSError:
        return False


def still_running(pids: List[int], wait: float = LEFTOVER_WAIT_S) -> List[int]:
    """Those of ``pids`` still running (zombies excluded) after waiting up to ``wait`` seconds
    for them to end."""
    deadline = time.monotonic() + wait
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def run_fault(scenario: str, timeout: float = 60, env: Optional[dict] = None,
              wrap: Optional[List[str]] = None, cwd: Optional[str] = None) -> FaultResult:
    """Runs ``scenario`` (see module doc); fails the test on a hang past ``timeout``.

    The scenario's output goes to files, not pipes, so that a worker outliving
    it (what some tests look for) cannot keep the harness waiting; the run is
    a session of its own, whose processes left over after a hang are killed.
    Only /dev/shm entries named for the run's own processes count as new.
    """
    timeout = max(timeout, HANG_GUARD_S)  # a start under load may take long: only a hang fails
    script = _HARNESS.format(scenario=textwrap.dedent(scenario))
    path = os.path.join(cwd or os.getcwd(), f"_fault_{os.getpid()}_{time.monotonic_ns()}.py")
    with open(path, "w") as f:
        f.write(script)
    try:
        command = (wrap or []) + [sys.executable, path]
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(command, stdout=out, stderr=err, text=True, cwd=cwd,
                                    env={**os.environ, **(env or {})}, start_new_session=True)
            try:
                returncode = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _kill_session(proc.pid)
                proc.wait()
                out.seek(0)
                err.seek(0)
                raise AssertionError(f"the scenario hung for {timeout} s:\n{out.read()}\n{err.read()}") from None
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
    finally:
        os.unlink(path)
    line = next((text for text in stdout.splitlines() if text.startswith("RESULT ")), None)
    assert line is not None, f"scenario printed no result (rc {returncode}):\n{stderr}"
    data = json.loads(line[len("RESULT "):])
    leftover = still_running(data["pids"])
    if leftover:
        _kill_session(proc.pid)  # the run's own processes: they would outlive the test
    return FaultResult(
        type=data["type"], message=data["message"], cause=data.get("cause", ""),
        exc_types=data.get("mro", []), seconds=data["seconds"], pids=data["pids"],
        stderr=stderr, stdout=stdout, returncode=returncode,
        leftover_pids=leftover,
        new_shm=sorted(own_shm_entries([proc.pid] + data["pids"])),
        traceback=data.get("traceback", ""),
    )


def _kill_session(session_id: int) -> None:
    """Kills what is left of a scenario's session (its process group has the same id)."""
    try:
        os.killpg(session_id, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def unshare_small_dev_shm(size: str = "16m") -> Optional[List[str]]:
    """A command prefix running a program with its own small /dev/shm, or None if impossible."""
    probe = ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs /dev/shm"]
    try:
        ok = subprocess.run(probe, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        return None
    return ["unshare", "-m", "sh", "-c",
            f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$0" "$@"']


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int):
    """A command prefix that runs a program in a new memory cgroup limited to ``limit_bytes``.

    Yields ``None`` where no cgroup can be made here (not root, no writable
    memory controller). The cgroup is removed afterwards.
    """
    from extsrc.shm.limits import own_cgroup_dirs

    made = None
    for version, parent, _mount_point in own_cgroup_dirs():
        limit_file = "memory.max" if version == "v2" else "memory.limit_in_bytes"
        if version == "v2" and "memory" not in open(os.path.join(parent, "cgroup.controllers")).read().split():
            continue
        directory = os.path.join(parent, f"extsrc-test-{os.getpid()}-{time.monotonic_ns()}")
        try:
            os.mkdir(directory)
            with open(os.path.join(directory, limit_file), "w") as f:
                f.write(str(limit_bytes))
            if version == "v1":  # no swap to fall back on: the limit is the limit
                try:
                    with open(os.path.join(directory, "memory.swappiness"), "w") as f:
                        f.write("0")
                except OSError:
                    pass
        except OSError:
            try:
                os.rmdir(directory)
            except OSError:
                pass
            continue
        made = directory
        break
    if made is None:
        yield None
        return
    try:
        yield ["sh", "-c", f'echo $$ > {made}/cgroup.procs && exec "$0" "$@"']
    finally:
        deadline = time.monotonic() + 10
        while True:
            try:
                os.rmdir(made)
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)


def run_isolated(code: str, timeout: float = 120, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """Runs ``code`` as a script in a fresh interpreter; a hang past ``timeout`` fails the test.

    The script can import the test helpers (``sources``, ...). Returns the
    completed process; the caller checks its output.
    """
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(tests_dir, f"_isolated_{os.getpid()}_{time.monotonic_ns()}.py")
    with open(path, "w") as f:
        f.write(textwrap.dedent(code))
    environment = dict(os.environ, **(env or {}))
    environment["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, environment.get("PYTHONPATH")) if p)
    try:
        return subprocess.run([sys.executable, path], capture_output=True, text=True,
                              timeout=timeout, env=environment, cwd=tests_dir)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the script hung for {timeout} s:\n{exc.stdout}\n{exc.stderr}") from None
    finally:
        os.unlink(path)
