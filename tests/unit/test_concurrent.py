"""The event-loop engine keeps its ``concurrency`` calls in flight across overlapping runs.

A worker with an ``async def`` callback runs each task as a run of :class:`AsyncEngine`;
the runs share one limit. Each call here waits for a future the test resolves, so
which call ends when is set by the test, not by timing.
"""

import asyncio

from extsrc.engine.concurrent import AsyncEngine

CONCURRENCY = 4


class Gate:
    """An async callback whose calls end when the test says; it records which started."""

    def __init__(self):
        self.started = []
        self.release = {}

    async def __call__(self, argument):
        future = asyncio.get_running_loop().create_future()
        self.release[argument] = future
        self.started.append(argument)
        await future
        return argument


async def settle():
    for _ in range(20):  # a few rounds of the loop: every callback that can run has run
        await asyncio.sleep(0)


def test_a_call_ending_in_one_run_lets_another_run_start_one_at_once():
    gate = Gate()
    engine = AsyncEngine(gate, CONCURRENCY)
    got = {"a": [], "b": []}

    async def main():
        jobs_a = [(k, f"a{k}") for k in range(2)]
        jobs_b = [(k, f"b{k}") for k in range(10)]
        run_a = asyncio.ensure_future(engine.run_shared(
            jobs_a, lambda pos, value: got["a"].append(value), None))
        await settle()
        run_b = asyncio.ensure_future(engine.run_shared(
            jobs_b, lambda pos, value: got["b"].append(value), None))
        await settle()
        assert gate.started == ["a0", "a1", "b0", "b1"]  # the limit is shared
        # Run a's calls end; run b has calls in flight and more to start: the room is b's
        # now, not when one of b's own calls ends.
        gate.release["a0"].set_result(None)
        gate.release["a1"].set_result(None)
        await settle()
        assert gate.started == ["a0", "a1", "b0", "b1", "b2", "b3"]
        assert (await run_a).event is None
        for k in range(10):
            await settle()
            gate.release[f"b{k}"].set_result(None)
        outcome = await run_b
        assert outcome.event is None
        return len(outcome.in_flight_ns)

    assert asyncio.run(main()) == 10
    assert got == {"a": ["a0", "a1"], "b": [f"b{k}" for k in range(10)]}


def test_an_earlier_run_gets_the_freed_room_first():
    gate = Gate()
    engine = AsyncEngine(gate, 1)

    async def main():
        runs = [asyncio.ensure_future(engine.run_shared([(0, name)], lambda p, v: None, None))
                for name in ("first", "second", "third")]
        await settle()
        assert gate.started == ["first"]
        gate.release["first"].set_result(None)
        await settle()
        assert gate.started == ["first", "second"]
        gate.release["second"].set_result(None)
        await settle()
        gate.release["third"].set_result(None)
        return [(await run).event for run in runs]

    assert asyncio.run(main()) == [None, None, None]
    assert gate.started == ["first", "second", "third"]


def test_an_interrupt_anywhere_in_starting_the_sample_threads_leaves_exactly_concurrency_threads():
    # A KeyboardInterrupt at every place one can land while the thread engine starts its
    # threads (in extsrc's code: each function's start, each C call's return). The next
    # start must leave exactly `concurrency` threads: a thread started but not yet recorded
    # was started a second time, one recorded but never started was counted for ever.
    # In its own interpreter: it counts the process's threads.
    from faultkit import run_isolated

    result = run_isolated('''
        import _thread, os, sys
        import extsrc
        from extsrc.engine.concurrent import ThreadEngine
        from interrupting import interrupt_at_landing
        from script_helpers import until

        base, k = _thread._count(), 0
        while True:
            k += 1
            engine = ThreadEngine(lambda argument: argument, 3)
            landings = [0]
            sys.setprofile(interrupt_at_landing(k, landings, os.path.dirname(extsrc.__file__)))
            try:
                engine._ensure_threads()
            except KeyboardInterrupt:
                pass
            finally:
                sys.setprofile(None)
            engine._ensure_threads()
            # A start interrupted after its C call returned did not wait for its thread to begin.
            until(lambda: _thread._count() - base == 3, f"{k}: not `concurrency` threads")
            engine.close()  # one stop per recorded thread: a thread not recorded would not end
            until(lambda: _thread._count() == base, f"{k}: a sample thread did not end")
            print(k, flush=True)
            if landings[0] < k:
                break
    ''', timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert len(result.stdout.split()) > 5, result.stdout  # so many places were interrupted
