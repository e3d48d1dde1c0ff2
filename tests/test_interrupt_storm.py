"""A storm of real SIGINTs during a loop: no batch lost, none repeated, no hang.

Another process sends SIGINT to the consumer every few hundred microseconds.
The consumer's SIGINT handler raises ``KeyboardInterrupt`` as Python's
default one does, except when the signal lands in the test's own loop code
(there an interrupt would lose a batch the test already had, which no library
can prevent). Half of the interrupts are followed by a second one while the
first is being handled: a trace function raises it at the k-th call (k
random) of an extsrc function after the first. After each interrupt the loop goes on with the same
iterator. Every epoch must give every batch exactly once, in order, until
1,000 interrupts have landed inside extsrc (or code it calls). Each case runs
in its own interpreter with a time limit, so a hang fails.
"""

import pytest

from faultkit import run_isolated, still_running

STORM = '''
import os, signal, subprocess, sys
import numpy as np
import extsrc

WANTED = {wanted}  # interrupts that land outside the test's own frames
landed = [0]

EXTSRC = os.path.dirname(extsrc.__file__)
rng = __import__("random").Random({seed})

def second_interrupt(after):
    """A trace function raising KeyboardInterrupt at the after-th call of an extsrc function.

    Calls, not lines: a function's start is where CPython runs signal handlers, while a line
    event also fires where no signal can land (before a with-statement's exit, for one)."""
    count = [0]
    def trace(frame, event, arg):
        if not frame.f_code.co_filename.startswith(EXTSRC):
            return None
        if event == "call":
            count[0] += 1
            if count[0] == after:
                sys.settrace(None)
                frame.f_trace = None
                landed[0] += 1
                raise KeyboardInterrupt("second")
        return trace
    return trace

stopping = [False]  # set first thing in the teardown: from there on, interrupts are not the test's

def on_sigint(signum, frame):
    if stopping[0] or (frame is not None and frame.f_globals is globals()):
        return  # in the test's loop itself (see the module doc), or in its teardown
    landed[0] += 1
    sys.settrace(None)
    if rng.random() < 0.5:
        sys.settrace(second_interrupt(rng.randint(1, 12)))
    raise KeyboardInterrupt("storm")

# The sender stops once the script has exited (it is then no longer the sender's parent: a
# script that exited but is not reaped yet still takes signals), and holds none of the pipes
# the test reads the script's output from.
SENDER = """
import os, random, signal, sys, time
pid, rng = int(sys.argv[1]), random.Random(int(sys.argv[2]))
while os.getppid() == pid:
    time.sleep(rng.uniform(0, 0.0008))
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        break
"""

{setup}

def one_epoch(make_iterator, expected):
    """Every batch of one epoch, taken through interrupts with the same iterator."""
    seen = []
    it = None
    while it is None:
        try:
            it = make_iterator()
        except KeyboardInterrupt:
            pass
    while True:
        try:
            for batch in it:
                seen.append(batch)  # a C call: the batch is in `seen` before any signal runs
            return seen
        except KeyboardInterrupt:
            pass

signal.signal(signal.SIGINT, on_sigint)
sender = subprocess.Popen([sys.executable, "-c", SENDER, str(os.getpid()), "{seed}"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
epochs = 0
try:
    while landed[0] < WANTED:
        seen = one_epoch(make_iterator, EXPECTED)
        got = [first_of(b) for b in seen]
        assert got == EXPECTED, (epochs, landed[0], got)
        epochs += 1
finally:
    # No Python function runs before these two (a handler running here sees this module's frame
    # and returns); after them, none raises. Then SIGINT is ignored before the sender is stopped.
    stopping[0] = True
    sys.settrace(None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sender.kill()
    sender.wait()
close()
print("landed", landed[0], "epochs", epochs)
'''

PARALLEL_SOURCE = '''
from sources import StopsAt
src = extsrc.ParallelSource(StopsAt(96), 4, num_workers=2)
EXPECTED = list(range(0, 96, 4))
make_iterator = lambda: iter(src)
first_of = lambda batch: int(batch[0][0])
close = src.close
'''

TORCH_LOADER = '''
import torch
from extsrc.torch import TorchLoader
from sources import StopsAt
src = extsrc.ParallelSource(StopsAt(96), 4, num_workers=2)
loader = TorchLoader(src)
EXPECTED = list(range(0, 96, 4))
make_iterator = lambda: iter(loader)
first_of = lambda batch: int(batch[0, 0])
close = loader.close
'''

def _check(result):
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
    words = result.stdout.split()
    assert int(words[words.index("landed") + 1]) >= 1000, result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_a_storm_of_interrupts_loses_and_repeats_no_batch_of_a_source(seed):
    _check(run_isolated(STORM.format(setup=PARALLEL_SOURCE, seed=seed, wanted=1000), timeout=300))


@pytest.mark.slow
def test_a_storm_of_interrupts_loses_and_repeats_no_batch_of_a_torch_loader():
    pytest.importorskip("torch")
    _check(run_isolated(STORM.format(setup=TORCH_LOADER, seed=3, wanted=1000), timeout=300))



FROM_DATASET_SAMPLER = '''
import torch
from extsrc.torch import from_dataset

class Numbers:
    def __len__(self):
        return 96
    def __getitem__(self, i):
        return torch.tensor([i])

loader = from_dataset(Numbers(), batch_size=4, num_workers=2, persistent_workers=True,
                      sampler=torch.utils.data.SequentialSampler(range(96)))
EXPECTED = list(range(0, 96, 4))
make_iterator = lambda: iter(loader)
first_of = lambda batch: int(batch[0, 0])
close = loader.close
'''


@pytest.mark.slow
def test_a_storm_of_interrupts_loses_and_repeats_no_batch_of_a_loader_with_a_sampler():
    pytest.importorskip("torch")
    _check(run_isolated(STORM.format(setup=FROM_DATASET_SAMPLER, seed=4, wanted=1000), timeout=300))


EXIT_STORM = '''
import os, signal, subprocess, sys
import numpy as np
import extsrc

def on_sigint(signum, frame):
    raise KeyboardInterrupt("at exit")

SENDER = """
import os, signal, sys, time
pid = int(sys.argv[1])
while os.getppid() == pid:  # see STORM's sender
    time.sleep(0.0002)
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        break
"""

src = extsrc.ParallelSource(lambda info: np.full(4, info.idx_in_epoch), 4, num_workers=2)
next(iter(src))
print("WORKERS", *src.worker_pids(), flush=True)
signal.signal(signal.SIGINT, on_sigint)
subprocess.Popen([sys.executable, "-c", SENDER, str(os.getpid())],
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
# The script ends with its source open: extsrc closes it at exit, under a storm of Ctrl-C.
'''


@pytest.mark.slow
@pytest.mark.parametrize("round", range(3))
def test_a_storm_of_interrupts_while_the_script_exits_neither_hangs_nor_leaves_workers(round):
    result = run_isolated(EXIT_STORM, timeout=120)
    pids = _worker_pids(result)
    # Mostly the close at exit reaps them; a Ctrl-C landing before it held SIGINT back leaves
    # them to the parent-death signal, which a busy machine may take a moment to deliver.
    assert not still_running(pids), pids


def _worker_pids(result):
    pids = [int(p) for line in result.stdout.splitlines() if line.startswith("WORKERS")
            for p in line.split()[1:]]
    assert len(pids) == 2, result.stdout + result.stderr[-3000:]
    return pids


EXIT_INTERRUPTED = '''
import os, signal, time
import numpy as np
import extsrc
from extsrc.engine.processes import ProcessBackend

src = extsrc.ParallelSource(lambda info: np.full(4, info.idx_in_epoch), 4, num_workers=2)
next(iter(src))
print("WORKERS", *src.worker_pids(), flush=True)
stop = ProcessBackend.stop

def stop_after_a_ctrl_c(self, ask):
    # The I/O thread stops the workers while the main thread waits for it in the close at exit:
    # a Ctrl-C now lands in that wait.
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.3)
    stop(self, ask)

ProcessBackend.stop = stop_after_a_ctrl_c
# The script ends with its source open: extsrc closes it at exit.
'''


def test_a_ctrl_c_during_the_close_at_exit_does_not_stop_it():
    result = run_isolated(EXIT_INTERRUPTED, timeout=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not still_running(_worker_pids(result), wait=0), \
        "the workers outlived the script: the close at exit did not end"
