"""The statistics' diagnosis from given figures: the side it names, and advice that changes something."""

import itertools
import re

from extsrc.engine.stats import SourceStats


def figures(**changes):
    base = dict(
        name="#0", seconds=10.0, batches=100, samples=3200, bytes=3200 << 10, wait_seconds=0.0,
        start_wait_seconds=0.0, worker_busy=(0.5, 0.5), callback_median_s=1e-3,
        callback_p95_s=2e-3, callback_max_s=3e-3, ready_ahead=0.0, ready_now=0,
        shared_memory_bytes=1 << 20, num_workers=2, prefetch=4, batch_size=32,
    )
    base.update(changes)
    return SourceStats(**base)


def test_a_loaded_machine_is_named_and_neither_side_is_blamed():
    # What a run beside CPU hogs looks like: 30% of the time in next() though 1.8 batches were
    # ready, workers half busy, and both sides runnable without a CPU much of the time while
    # this source used 0.6 of 2 cores.
    stats = figures(wait_seconds=3.0, ready_ahead=1.8, worker_busy=(0.5, 0.45),
                    workers_cpu_wait=(0.4, 0.45), consumer_cpu_wait=0.3, own_cpu_cores=0.6, cores=2)
    text = stats.diagnosis()
    assert stats.kind == "machine busy" and text.startswith("Machine busy")
    assert "other programs" in text and "0.6 of the 2 cores" in text
    assert "Take larger batches" not in text and "Consumer-bound" not in text
    assert "add workers" not in text and "fewer workers" not in text


def test_workers_crowding_each_other_out_are_not_a_busy_machine():
    # Waiting for a CPU, but the source's own processes used every core: no other program.
    stats = figures(wait_seconds=3.0, worker_busy=(0.95, 0.95), workers_cpu_wait=(0.3, 0.3),
                    consumer_cpu_wait=0.2, own_cpu_cores=1.95, cores=2)
    assert stats.kind == "input-bound"


def test_a_worker_s_own_threads_waiting_on_an_idle_machine_are_not_a_busy_machine():
    # concurrency=32 on threads: many threads wake at once and queue for the CPU (their waits,
    # summed, are large) while the source uses 0.4 of 2 cores and the cores are idle the rest
    # of the time: no other program took them.
    crowded = dict(wait_seconds=9.0, worker_busy=(1.0, 1.0), workers_cpu_wait=(0.7, 0.7),
                   consumer_cpu_wait=0.0, own_cpu_cores=0.4, cores=2, concurrency=32,
                   in_flight_mean=29.0, worker_cpu_share=0.2, worker_runq_share=0.1,
                   callback_median_s=0.02)
    stats = figures(idle_cores=1.5, **crowded)
    assert stats.kind == "input-bound", stats.diagnosis()
    assert "Machine busy" not in stats.diagnosis()
    assert "0.1 by other programs" in str(stats)
    # The same waits while other programs kept the cores busy: the machine is named.
    busy = figures(idle_cores=0.2, **crowded)
    assert busy.kind == "machine busy"
    assert "0.4 and other programs 1.4 of the 2 cores" in busy.diagnosis()


def test_workers_waiting_on_io_are_told_to_keep_more_in_flight_on_a_busy_machine_too():
    # A callback that waits 20 ms a sample beside 4 CPU hogs: the consumer waited for batches
    # nearly all the time and for a CPU 28% of it; the workers, busy all the time, were on a
    # CPU 1% of it and waited for one 4%. Other programs cannot make a wait on I/O longer.
    waiting = dict(wait_seconds=9.5, worker_busy=(0.99,), num_workers=1, workers_cpu_wait=(0.04,),
                   consumer_cpu_wait=0.28, own_cpu_cores=0.02, cores=2, worker_cpu_share=0.01,
                   worker_runq_share=0.02, in_flight_mean=1.0, callback_median_s=0.02)
    stats = figures(idle_cores=0.0, **waiting)
    assert stats.machine_busy and stats.kind == "input-bound"
    text = stats.diagnosis()
    assert "concurrency=" in text and "not more workers" in text, text
    assert "Other programs also used 2.0 of the 2 cores" in text
    # The same beside a heavier load: a CPU 16% of the time, I/O 83% (a CI run's figures).
    heavier = figures(idle_cores=0.0, **{**waiting, "workers_cpu_wait": (0.16,), "worker_runq_share": 0.16})
    assert heavier.kind == "input-bound" and "concurrency=" in heavier.diagnosis(), heavier.diagnosis()
    # Workers that waited for a CPU about as long as on I/O: the busy machine is the verdict.
    crowded = figures(idle_cores=0.0, **{**waiting, "workers_cpu_wait": (0.45,), "worker_runq_share": 0.45,
                                         "worker_cpu_share": 0.05})
    assert crowded.kind == "machine busy", crowded.diagnosis()


def test_batches_ready_when_taken_are_not_a_wait_for_the_workers():
    stats = figures(wait_seconds=3.0, ready_ahead=1.8, worker_busy=(0.9, 0.9))
    assert not stats.input_bound and stats.kind == "per-batch cost"
    assert "add workers" not in stats.diagnosis() and "Input-bound" not in stats.diagnosis()


def test_without_scheduler_figures_the_diagnosis_stays_as_before():
    assert figures(wait_seconds=5.0, worker_busy=(0.95, 0.9)).kind == "input-bound"
    assert figures(wait_seconds=0.1, ready_ahead=2.5).kind == "consumer-bound"
    assert figures(wait_seconds=0.1, ready_ahead=0.3).kind == "balanced"
    assert figures(batches=0).kind == "none"


def test_the_advice_never_is_the_current_setting():
    advised = re.compile(r"\b(num_workers|prefetch|batch_size)=(\d+)")
    checked = 0
    for workers, busy, wait, ready, prefetch, batch_size in itertools.product(
        (1, 2, 3, 4, 8), (0.0, 0.3, 0.6, 0.8, 0.85, 0.9, 1.0), (0.0, 0.05, 0.5),
        (0.0, 0.5, 1.0, 1.8), (1, 2, 4), (1, 32),
    ):
        stats = figures(num_workers=workers, worker_busy=(busy,) * workers, wait_seconds=10 * wait,
                        ready_ahead=ready, prefetch=prefetch, batch_size=batch_size)
        current = {"num_workers": workers, "prefetch": prefetch, "batch_size": batch_size}
        for name, value in advised.findall(stats.diagnosis()):
            checked += 1
            assert int(value) != current[name], (current, stats.diagnosis())
    assert checked > 100


def test_consumer_bound_at_two_busy_workers_does_not_advise_two_workers():
    stats = figures(wait_seconds=0.1, ready_ahead=1.5, worker_busy=(0.85, 0.85))
    assert stats.kind == "consumer-bound"
    assert "num_workers=2" not in stats.diagnosis() and "would not help" in stats.diagnosis()
