"""Threads in the consumer's process (several on one source, those extsrc starts), and
processes forked from it.

Each case runs in its own interpreter with a time limit (a hang fails the test).
"""

import pytest

from faultkit import run_isolated


def check(result):
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return result.stdout


def test_threads_sharing_an_epoch_get_every_batch_once_and_whole():
    out = check(run_isolated('''
        import threading
        import extsrc
        from sources import jittered

        class Data:
            def __call__(self, info):
                if info.idx_in_epoch >= 400:
                    raise StopIteration
                return jittered(info)

        src = extsrc.ParallelSource(Data(), 4, num_workers=2)
        for epoch in range(3):
            it = iter(src)
            got = [[], [], []]
            def consume(k):
                for batch in it:
                    got[k].append([int(s[0]) for s in batch])
            threads = [threading.Thread(target=consume, args=(k,)) for k in range(3)]
            for t in threads: t.start()
            for t in threads: t.join()
            batches = sorted(b for g in got for b in g)
            assert batches == [[k, k + 1, k + 2, k + 3] for k in range(0, 400, 4)], batches[:3]
            assert sum(1 for g in got if g) >= 2, "one thread took everything"
        src.close()
        print("ok")
    ''', timeout=120))
    assert out.strip() == "ok"


def test_a_new_epoch_in_one_thread_ends_the_epoch_another_thread_iterates():
    out = check(run_isolated('''
        import threading, time
        import extsrc
        from sources import StopsAt

        src = extsrc.ParallelSource(StopsAt(400), 4, num_workers=2)
        it = iter(src)
        next(it)
        other = []
        t = threading.Thread(target=lambda: other.extend(int(b[0][0]) for b in it))
        t.start()
        time.sleep(0.01)
        fresh = [int(b[0][0]) for b in iter(src)]
        t.join(30)
        assert not t.is_alive()
        assert fresh == list(range(0, 400, 4)), fresh[:5]
        assert other == list(range(4, 4 + 4 * len(other), 4))  # what it got before the end was right
        src.close()
        print("ok")
    ''', timeout=120))
    assert out.strip() == "ok"


FORK_CHILD = '''
    import os, sys, time
    import extsrc
    from sources import sample_of

    src = extsrc.ParallelSource(sample_of, 4, num_workers=2)
    it = iter(src)
    held = [next(it) for _ in range(3)]
    pids = src.worker_pids()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a library's worker, a DataLoader, os.fork() by the user
        os.close(r)
        out = []
        for use in (lambda: next(it), lambda: iter(src), src.start, lambda: src.get_state()):
            try:
                use()
                out.append("used")
            except extsrc.ForkedChildError:
                out.append("refused")
        time.sleep(0.3)  # meanwhile the parent drops its batches and takes new ones
        out.append(",".join(str(int(b[0][0])) for b in held))
        src.close()  # a no-op in the child
        os.write(w, " ".join(out).encode())
        {child_exit}
    os.close(w)
    del held
    later = [int(next(it)[0][0]) for _ in range(20)]
    child = os.read(r, 1000).decode()
    os.waitpid(pid, 0)
    time.sleep(0.3)
    alive = [os.path.exists(f"/proc/{{p}}") and open(f"/proc/{{p}}/stat").read().split()[2] != "Z" for p in pids]
    more = [int(next(it)[0][0]) for _ in range(3)]
    src.close()
    print(child, "|", alive, later == list(range(12, 92, 4)), more == [92, 96, 100])
'''


@pytest.mark.parametrize("child_exit", ["sys.exit(0)", "os._exit(0)", "raise SystemExit(3)"])
def test_a_forked_child_cannot_use_the_source_reads_held_batches_and_leaves_the_workers_alone(child_exit):
    out = check(run_isolated(FORK_CHILD.format(child_exit=child_exit), timeout=120))
    child, parent = out.strip().split(" | ")
    # every use refused; the held batches read right although the parent reused memory since
    assert child == "refused refused refused refused 0,4,8"
    assert parent == "[True, True] True True"  # the parent's workers live on and serve it


def test_fork_workers_of_one_source_hold_no_memory_of_another():
    out = check(run_isolated('''
        import os
        import numpy as np
        import extsrc
        from sources import sample_of

        def big(info):
            return np.full((1 << 20,), info.idx_in_epoch % 250, np.uint8)

        def references(pid, word):
            with open(f"/proc/{pid}/maps") as f:
                maps = sum(word in line for line in f)
            fds = 0
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    fds += word in os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    pass
            return maps + fds

        alpha = extsrc.ParallelSource(big, 8, num_workers=1, name="alpha")
        it = iter(alpha)
        held = [next(it) for _ in range(3)]  # held memory: inherited by plain forks
        beta = extsrc.ParallelSource(sample_of, 4, num_workers=2, name="beta")
        next(iter(beta))
        assert references(os.getpid(), "alpha") > 0
        print([references(pid, "alpha") for pid in beta.worker_pids()],
              all(references(pid, "beta") > 0 for pid in beta.worker_pids()))
        alpha.close()
        beta.close()
    ''', timeout=120))
    assert out.strip() == "[0, 0] True"


def test_an_interrupt_in_a_fork_leaves_the_fork_count_right_and_other_threads_free_to_start_sources():
    # A KeyboardInterrupt raised at the k-th call of extsrc's Python code during os.fork() (where
    # a Ctrl-C would be raised), for every k that lands in a fork hook. The fork count must still
    # go up by one each time (a held batch's memory must not be reused after a fork), and a source
    # started in another thread afterwards must not wait forever for a lock the fork left taken.
    out = check(run_isolated('''
        import os, sys, threading
        import numpy as np
        import extsrc
        from extsrc import forking
        from interrupting import interrupt_at_call

        EXTSRC = os.path.dirname(extsrc.__file__)

        held = extsrc.ParallelSource(lambda info: np.full(4, info.idx_in_epoch), 4, num_workers=1)
        batch = next(iter(held))  # a held batch: the fork hooks have memory to look at
        k = 0
        while True:
            k += 1
            calls, before = [0], forking.generation()
            sys.settrace(interrupt_at_call(k, calls, EXTSRC))
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            sys.settrace(None)
            os.waitpid(pid, 0)
            assert forking.generation() == before + 1, (k, forking.generation(), before)
            if calls[0] < k:
                break  # every call of the fork's hooks has been interrupted once
        print("interrupted", k - 1, "calls")

        def use_a_source():
            src = extsrc.ParallelSource(lambda info: np.full(4, info.idx_in_epoch), 4,
                                        num_workers=1, start_method="fork")
            got.append(int(next(iter(src))[1][0]))
            src.close()

        got = []
        user = threading.Thread(target=use_a_source, daemon=True)
        user.start()
        user.join(60)  # a hang guard: the source starts in well under a second
        if user.is_alive():
            print("HUNG", flush=True)
            os._exit(3)
        assert got == [1], got
        held.close()
        print("OK")
    ''', timeout=180))
    assert "OK" in out, out
    interrupted = int(out.split()[out.split().index("interrupted") + 1])
    assert interrupted >= 1, out


@pytest.mark.slow
def test_an_interrupted_forkserver_start_harms_neither_the_next_start_nor_other_sources():
    # A KeyboardInterrupt at the k-th call of extsrc's or multiprocessing's Python code in the
    # consumer's thread while a forkserver source starts, for every k up to the start's last
    # such call. Interrupted half way through a request, multiprocessing's fork server exits: the
    # next start is refused, and the workers of every other forkserver source look dead.
    # Interrupted between starting its workers and its I/O thread, a pool ran without the thread
    # (a hang) or started its workers twice. After each interrupted start, the source must start
    # again and give its epoch, and a source started before must go on giving its own.
    out = check(run_isolated('''
        import multiprocessing, os, sys
        import extsrc
        from interrupting import interrupt_at_call
        from script_helpers import eight, epoch

        WATCHED = (os.path.dirname(extsrc.__file__), os.path.dirname(multiprocessing.__file__))

        if __name__ == "__main__":
            script = __file__  # hidden while workers start, and back after every start
            other = extsrc.ParallelSource(eight, 2, num_workers=1, start_method="forkserver")
            assert epoch(other) == list(range(8))
            src = extsrc.ParallelSource(eight, 2, num_workers=1, start_method="forkserver")
            k = 0
            while True:
                k += 1
                calls = [0]
                sys.settrace(interrupt_at_call(k, calls, WATCHED))
                try:
                    iter(src)
                except KeyboardInterrupt:
                    pass
                sys.settrace(None)
                assert epoch(src) == list(range(8)), k
                assert epoch(other) == list(range(8)), k
                src.close()  # the next round starts it anew
                src = extsrc.ParallelSource(eight, 2, num_workers=1, start_method="forkserver")
                if calls[0] < k:
                    break
            assert epoch(src) == list(range(8))  # a start no interrupt cuts
            assert globals().get("__file__") == script, "__main__.__file__ was not restored"
            other.close()
            src.close()
            print("interrupted", k - 1, "calls")
    ''', timeout=300))
    assert int(out.split()[out.split().index("interrupted") + 1]) >= 20, out


def test_an_interrupted_thread_start_leaves_no_thread_stuck_and_join_waits_for_any_thread_made():
    # A KeyboardInterrupt at the k-th call or return of Python code (extsrc's, threading's) in
    # OwnedThread.start(), for every k up to the last: a return stands for a Ctrl-C landing just
    # after the C call that ends a function. threading.Thread.start() waits on an Event for the
    # new thread: interrupted as it had just taken the Event's lock, it left the lock held, and
    # the new thread blocked before its target for ever (a storm hung so); interrupted in the
    # wait, it raised RuntimeError for a thread it had made. A thread made must run its target
    # once, and join() must wait for it; no thread may be left behind.
    out = check(run_isolated('''
        import _thread, os, sys, threading
        import extsrc
        from extsrc.engine.threads import OwnedThread
        from interrupting import interrupt_at_call
        from script_helpers import HANG_GUARD_S, until

        WATCHED = (os.path.dirname(extsrc.__file__), threading.__file__)

        def threads_back_to(count):
            until(lambda: _thread._count() == count, "a thread is stuck")

        base, ran, k = _thread._count(), [], 0
        while True:
            k += 1
            events = [0]
            thread = OwnedThread(lambda k=k: ran.append(k), f"interrupted-{k}")
            sys.settrace(interrupt_at_call(k, events, WATCHED, returns=True))
            try:
                thread.start()  # a RuntimeError here (no thread could be made) fails the test
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(None)
            joined = thread.join(HANG_GUARD_S)
            threads_back_to(base)  # every thread made has ended: none is stuck
            assert joined == (k in ran), (k, joined, ran[-3:])  # join() waited for a thread made
            assert ran.count(k) <= 1, k
            if events[0] < k:
                break  # every event of the start has been interrupted once
        print("interrupted", k - 1, "events")
        later = OwnedThread(lambda: ran.append("later"), "later")
        later.start()
        assert later.join(HANG_GUARD_S) and ran[-1] == "later"
    ''', timeout=180))
    assert int(out.split()[out.split().index("interrupted") + 1]) >= 2, out


@pytest.mark.slow
def test_an_interrupt_in_threading_code_while_forkserver_workers_start_keeps_no_worker_half_started():
    # A KeyboardInterrupt at the k-th call or return of threading's Python code in the consumer's
    # thread while a forkserver source starts its two workers, for every k up to the last. Each
    # worker starts on a thread of its own; threading.Thread.start() interrupted in its wait
    # raised RuntimeError for the thread it had made, the start was taken for one that never
    # began, and the pool kept a worker whose process was still being started on that thread:
    # stopping it failed ("can only join a started process"), as a storm of interrupts found.
    # After each interrupted start, the source must start again and give its epoch.
    out = check(run_isolated('''
        import sys, threading
        import extsrc
        from interrupting import interrupt_at_call
        from script_helpers import eight, epoch

        WATCHED = (threading.__file__,)

        if __name__ == "__main__":
            k = 0
            while True:
                k += 1
                events = [0]
                src = extsrc.ParallelSource(eight, 2, num_workers=2, start_method="forkserver")
                sys.settrace(interrupt_at_call(k, events, WATCHED, returns=True))
                try:
                    iter(src)
                except KeyboardInterrupt:
                    pass
                finally:
                    sys.settrace(None)
                assert epoch(src) == list(range(8)), k
                src.close()
                if events[0] < k:
                    break
            print("interrupted", k - 1, "events")
    ''', timeout=300))
    assert int(out.split()[out.split().index("interrupted") + 1]) >= 2, out


def test_an_interrupt_anywhere_in_hiding_the_main_script_leaves_it_restored_after_the_next_start():
    # A spawn worker starts in the consumer's thread, where a Ctrl-C lands: while it starts,
    # __main__'s __file__ and __spec__ are hidden (the worker must not import the script). An
    # interrupt at any call of that hiding and its undoing must leave them restored, at the
    # latest once the next start ended: a script that reads __file__ later must find it.
    out = check(run_isolated('''
        import os, sys
        import extsrc
        from extsrc.engine import workers
        from interrupting import interrupt_at_call

        EXTSRC = os.path.dirname(extsrc.__file__)
        main = sys.modules["__main__"]
        script = main.__file__
        k = 0
        while True:
            k += 1
            calls = [0]
            sys.settrace(interrupt_at_call(k, calls, EXTSRC))
            try:
                with workers._main_hidden(True):
                    pass
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(None)
            with workers._main_hidden(True):  # the next start, not interrupted
                assert "__file__" not in main.__dict__ and main.__spec__ is None, k
            assert main.__dict__.get("__file__") == script, (k, main.__dict__.get("__file__"))
            if calls[0] < k:
                break
        print("interrupted", k - 1, "calls")
    ''', timeout=120))
    assert int(out.split()[out.split().index("interrupted") + 1]) >= 3, out


def test_overlapping_forkserver_starts_send_no_worker_the_main_script_to_import():
    # Two forkserver starts overlap (here one in another thread; in a storm of interrupts, the
    # start an interrupted launch left running on its thread and the next launch's): the first
    # ends while the second is still in its start. The second worker must not be told to import
    # the main script (a script without a __main__ guard would run in it), and the script's
    # __file__ must be back once both ended. Each start is held at multiprocessing's preparation
    # of the worker's data until the other got there: no timing decides the order.
    out = check(run_isolated('''
        import multiprocessing.spawn, sys, threading
        import extsrc
        from script_helpers import HANG_GUARD_S, eight, epoch

        prepare = multiprocessing.spawn.get_preparation_data
        first_in, second_in, first_started = threading.Event(), threading.Event(), threading.Event()
        sent = []  # whether each worker was told to import the main script

        def held_prepare(name):
            if name == "ignore":  # the fork server's own start
                return prepare(name)
            if not first_in.is_set():
                first_in.set()
                data = prepare(name)
                assert second_in.wait(HANG_GUARD_S), "the second start never came"
            else:
                second_in.set()
                assert first_started.wait(HANG_GUARD_S), "the first start never ended"
                data = prepare(name)
            sent.append(any(key.startswith("init_main_from") for key in data))
            return data

        def start_first(source):
            iter(source)
            first_started.set()

        if __name__ == "__main__":
            script = __file__
            multiprocessing.spawn.get_preparation_data = held_prepare
            first = extsrc.ParallelSource(eight, 2, num_workers=1, start_method="forkserver")
            second = extsrc.ParallelSource(eight, 2, num_workers=1, start_method="forkserver")
            starter = threading.Thread(target=start_first, args=(first,))
            starter.start()
            assert first_in.wait(HANG_GUARD_S)
            iter(second)
            starter.join()
            assert sent == [False, False], sent
            assert epoch(first) == list(range(8)) and epoch(second) == list(range(8))
            assert sys.modules["__main__"].__file__ == script
            first.close()
            second.close()
            print("OK")
    ''', timeout=120))
    assert "OK" in out, out


def test_an_interrupt_while_forkserver_workers_start_is_raised_once_the_pool_runs():
    # A Ctrl-C (a real SIGINT to the main thread) while a forkserver worker starts: it is held
    # until every worker started, and raised once the pool committed its start. Raised at once,
    # it made the pool undo a start of tens of milliseconds, stopping half-started workers;
    # under a storm of interrupts no start ever finished. The next iter() must find the pool
    # running with the same workers. The interrupt is sent from inside the worker's start, once
    # the main thread waits for it: no timing decides where it lands.
    out = check(run_isolated('''
        import multiprocessing.spawn, signal, threading
        import extsrc
        from script_helpers import HANG_GUARD_S, eight, epoch, until, waits_in

        MAIN = threading.get_ident()
        prepare = multiprocessing.spawn.get_preparation_data
        landed = threading.Event()

        def on_sigint(signum, frame):
            landed.set()
            raise KeyboardInterrupt("while a worker starts")

        def interrupting_prepare(name):
            if name != "ignore" and not landed.is_set():  # not the fork server's own start
                # In OwnedThread.join(), waiting for this start:
                until(lambda: waits_in(MAIN, "join"), "the main thread never waited")
                signal.pthread_kill(MAIN, signal.SIGINT)
                assert landed.wait(HANG_GUARD_S), "the interrupt never landed"
            return prepare(name)

        if __name__ == "__main__":
            src = extsrc.ParallelSource(eight, 2, num_workers=2, start_method="forkserver")
            signal.signal(signal.SIGINT, on_sigint)
            multiprocessing.spawn.get_preparation_data = interrupting_prepare
            try:
                iter(src)
            except KeyboardInterrupt:
                pass
            else:
                raise AssertionError("the interrupt was not raised")
            assert landed.is_set()
            pids = src.worker_pids()
            assert len(pids) == 2, pids  # the pool runs: the interrupt came after its start
            assert epoch(src) == list(range(8))
            assert src.worker_pids() == pids  # no second start
            src.close()
            print("OK")
    ''', timeout=120))
    assert "OK" in out, out


def test_an_interrupt_after_the_hold_ends_the_wait_and_leaves_no_forkserver_worker():
    # Past INTERRUPT_HOLD_S (a fork server that stopped answering; here the hold is made 0 and
    # a worker's start is held back until the interrupt was raised), a Ctrl-C is raised at once:
    # the pool stays NEW, and the workers its start thread goes on to start are stopped by that
    # thread. Then no worker of the fork server may be left, and the source starts again.
    out = check(run_isolated('''
        import _thread, multiprocessing.forkserver, multiprocessing.spawn, signal, threading
        import extsrc
        from extsrc.engine import workers
        from script_helpers import HANG_GUARD_S, children_of, eight, epoch, until, waits_in

        MAIN = threading.get_ident()
        prepare = multiprocessing.spawn.get_preparation_data
        raised = threading.Event()

        def stuck_prepare(name):
            if name != "ignore" and not raised.is_set():  # not the fork server's own start
                until(lambda: waits_in(MAIN, "join"), "the main thread never waited")
                signal.pthread_kill(MAIN, signal.SIGINT)
                assert raised.wait(HANG_GUARD_S), "the interrupt was not raised"
            return prepare(name)

        def server_children():
            return children_of(multiprocessing.forkserver._forkserver._forkserver_pid)

        if __name__ == "__main__":
            # Python leaves SIGINT ignored when it started so (a test run started in the
            # background by a shell): Ctrl-C's own handler, for the SIGINT sent below.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            warm = extsrc.ParallelSource(eight, 2, num_workers=1, start_method="forkserver")
            assert epoch(warm) == list(range(8))  # the fork server runs
            warm.close()
            until(lambda: not server_children(), "the first source's worker stayed")
            threads = _thread._count()
            workers.INTERRUPT_HOLD_S = 0.0
            multiprocessing.spawn.get_preparation_data = stuck_prepare
            src = extsrc.ParallelSource(eight, 2, num_workers=2, start_method="forkserver")
            try:
                iter(src)
            except KeyboardInterrupt:
                pass
            else:
                raise AssertionError("the interrupt was not raised")
            raised.set()
            assert src.worker_pids() == []  # the pool did not start
            until(lambda: _thread._count() == threads, "the start thread did not end")
            until(lambda: not server_children(), f"workers left: {server_children()}")
            multiprocessing.spawn.get_preparation_data = prepare
            assert epoch(src) == list(range(8))
            src.close()
            print("OK")
    ''', timeout=120))
    assert "OK" in out, out


def test_the_dali_run_thread_ends_with_its_owner_even_when_an_interrupt_skipped_its_stop():
    # The drop-in runs DALI's run() on a thread of the pipeline's (extsrc.dali.run_thread). A
    # pipeline whose close() an interrupt cut short before it stopped that thread, or whose
    # construction was interrupted just after the thread started, is dropped without stop():
    # the thread held its owner and polled for ever, one more thread per such pipeline. It must
    # end once nothing references its owner; a KeyboardInterrupt at every call or return of the
    # construction must leave no thread behind.
    out = check(run_isolated('''
        import _thread, gc, os, sys
        import extsrc
        from extsrc.dali.run_thread import RUN, RunThread
        from interrupting import interrupt_at_call
        from script_helpers import until

        EXTSRC = os.path.dirname(extsrc.__file__)
        base = _thread._count()

        def no_thread_left(case):
            gc.collect()
            until(lambda: _thread._count() == base, f"the run thread outlived its owner: {case}")

        runner = RunThread("dropped")
        runner.start(RUN, lambda: 7)
        assert runner.collect() == 7
        del runner  # as a pipeline whose close() was cut short before stop()
        no_thread_left("dropped after a call")

        k = 0
        while True:
            k += 1
            events = [0]
            sys.settrace(interrupt_at_call(k, events, EXTSRC, returns=True))
            try:
                runner = RunThread(f"interrupted-{k}")
            except KeyboardInterrupt:
                runner = None
            finally:
                sys.settrace(None)
            if runner is not None:
                runner.stop()
                runner = None
            no_thread_left(f"construction interrupted at event {k}")
            if events[0] < k:
                break
        print("interrupted", k - 1, "events")
    ''', timeout=120))
    assert int(out.split()[out.split().index("interrupted") + 1]) >= 4, out


def test_a_fork_worker_never_runs_the_finalizer_of_the_parents_garbage():
    # A cycle the parent had not collected yet was collected in a fork worker too, running its
    # finalizer there: a DALI pipeline's waits for threads the worker does not have, and the
    # worker hung for good (seen with DALI's dynamic mode in the suite beside busy processes).
    out = check(run_isolated('''
        import gc, os
        import numpy as np
        import extsrc

        read_end, write_end = os.pipe()

        class Finalized:
            def __del__(self):
                os.write(write_end, f"{os.getpid()} ".encode())

        def collects(info):
            if info.idx_in_epoch >= 8:
                raise StopIteration
            gc.collect()
            return np.zeros(4)

        gc.disable()
        cycle = Finalized()
        cycle.me = cycle
        del cycle  # garbage, left for the collector
        with extsrc.ParallelSource(collects, 4, num_workers=2, start_method="fork") as src:
            assert len(list(src)) == 2
            workers = set(src.worker_pids())
        gc.enable()
        gc.collect()
        os.close(write_end)
        finalized_in = [int(p) for p in os.read(read_end, 4096).split()]
        assert finalized_in == [os.getpid()], (finalized_in, workers)
        print("ok")
    ''', timeout=120))
    assert "ok" in out
