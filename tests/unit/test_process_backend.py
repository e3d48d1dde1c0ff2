"""The processes backend on its own: what it reports when a worker ends."""

import time

import pytest

from extsrc.engine.hooks import WorkerHooks
from extsrc.engine.pickling import Pickler
from extsrc.engine.processes import ProcessBackend
from extsrc.engine.protocol import SourceSetup, Task
from extsrc.engine.workers import Waker


def _refuse(worker, num_workers):
    raise RuntimeError(f"worker {worker} of {num_workers} has no credentials")


def _source() -> SourceSetup:
    return SourceSetup(source_id=0, name="refusing", kind="sample", callback=lambda info: None,
                       pickled=False, batch_size=2, num_outputs=None, dtypes=(), ndims=(),
                       hooks=WorkerHooks(worker_init=_refuse), num_workers=1)


def _task() -> Task:
    return Task(source_id=0, ticket=1, slot_id=0, batch_seq=0, epoch_idx=0, iteration=0,
                start=0, stop=2, region_bytes=0, give_back=True, regions=())


@pytest.fixture
def backend():
    waker = Waker()
    backend = ProcessBackend(1, "fork", Pickler())
    backend.start((_source(),), waker)
    yield backend
    backend.stop(ask=False)
    waker.close()


# Only a hang ends the wait: a worker that fails its setup exits within a second even on a
# loaded machine.
EXIT_WAIT_S = 120


def _wait_for_exit(backend) -> None:
    """Until the worker has exited (a zombie until the backend reaps it)."""
    (pid,) = backend.worker_pids()
    deadline = time.monotonic() + EXIT_WAIT_S
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        time.sleep(0.01)
    pytest.fail(f"the worker (pid {pid}) did not exit after failing its setup")


def test_a_task_sent_to_a_worker_that_failed_setup_reports_the_setup_failure(backend):
    # The worker says why it cannot serve and exits; a task sent after that finds the pipe
    # broken. The user must read the reason, not "the worker exited with code 0".
    _wait_for_exit(backend)
    backend.assign(0, _task())
    fault = backend.flush()
    assert fault is not None
    error = fault(lambda worker: "samples 0..1")
    assert isinstance(error, RuntimeError)
    assert "could not load the sources" in str(error)
    assert "worker 0 of 1 has no credentials" in str(error)


def test_the_setup_failure_is_reported_when_the_worker_is_seen_to_end(backend):
    _wait_for_exit(backend)
    received = backend.receive(backend.wait(None))
    assert received.fault is not None
    error = received.fault(lambda worker: "no samples")
    assert "worker 0 of 1 has no credentials" in str(error)
