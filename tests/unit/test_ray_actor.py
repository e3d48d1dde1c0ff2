"""extsrc.ray.actor.SourceActor's calls, without Ray: tasks run in the actor's own thread in
the order they came; a call answers what finished, in pairs where it can, and never waits for
a slow task to answer a finished one."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

import extsrc.ray.actor as actor_module
from extsrc.ray.actor import SourceActor

CALL_LIMIT_S = 10.0  # a call that has not answered by then hangs


class Runner:
    """Answers task ``n`` with ``("done", n)``; tasks in ``gates`` wait for their event."""

    def __init__(self):
        self.gates = {}
        self.ran = []

    def run(self, task):
        gate = self.gates.get(task.n)
        if gate is not None:
            gate.wait(CALL_LIMIT_S)
        if task.n == "bug":
            raise RuntimeError("not the callback: the runner itself")
        self.ran.append(task.n)
        return ("done", task.n)


def tasks(*numbers):
    return tuple(SimpleNamespace(source_id=0, n=n) for n in numbers)


@pytest.fixture
def actor():
    made = SourceActor(0, (), None)
    made.runners[0] = Runner()
    return made


def call(actor, *numbers):
    """``actor.run`` in another thread, failing the test if it does not answer in time."""
    out = {}

    def go():
        try:
            out["answer"] = actor.run(tasks(*numbers))
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(CALL_LIMIT_S)
    assert not thread.is_alive(), "the call did not answer"
    if "error" in out:
        raise out["error"]
    return out["answer"]


def test_a_call_answers_two_finished_tasks_at_once(actor, monkeypatch):
    monkeypatch.setattr(actor_module, "REPLY_HOLD_S", CALL_LIMIT_S / 2)  # room on a loaded machine
    second = actor.runners[0].gates[2] = threading.Event()
    gate = actor.runners[0].gates[3] = threading.Event()
    threading.Timer(0.2, second.set).start()  # task 2 ends well after task 1
    assert call(actor, 1, 2, 3) == [("done", 1), ("done", 2)]
    gate.set()
    assert call(actor) == [("done", 3)]  # nothing new: the answer of what it still held


def test_a_slow_task_does_not_hold_back_a_finished_one(actor):
    gate = actor.runners[0].gates[2] = threading.Event()
    assert call(actor, 1, 2) == [("done", 1)]  # while task 2 still runs
    gate.set()
    answers = call(actor, 3)
    while len(answers) < 2:
        answers += call(actor)
    assert answers == [("done", 2), ("done", 3)]


def test_tasks_run_in_the_order_they_came_over_calls_and_a_call_with_nothing_held_is_empty(actor):
    answers = call(actor, 1, 2) + call(actor, 3)
    while len(answers) < 3:
        answers += call(actor)
    assert answers == [("done", 1), ("done", 2), ("done", 3)]
    assert actor.runners[0].ran == [1, 2, 3]
    assert call(actor) == []


def test_a_failure_outside_the_callback_fails_every_later_call_instead_of_hanging(actor):
    with pytest.raises(RuntimeError, match="the runner itself"):
        call(actor, "bug")
    with pytest.raises(RuntimeError, match="the runner itself"):
        call(actor, 1)


def test_sources_that_did_not_load_are_the_answer_to_every_call():
    class Refuses:
        def loads(self, data):
            raise ValueError("cannot load this")

    source = SimpleNamespace(source_id=0, pickled=True, callback=b"x")
    broken = SourceActor(3, (source,), Refuses())
    answer = broken.run(tasks(1), 2)
    assert len(answer) == 3 and answer[1:] == (None, None)
    assert answer[0].worker == 3 and "ValueError: cannot load this" in answer[0].message
