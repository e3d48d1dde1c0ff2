
import os, signal, subprocess, sys
import numpy as np
import extsrc

WANTED = 1000  # interrupts that land outside the test's own frames
landed = [0]

EXTSRC = os.path.dirname(extsrc.__file__)
rng = __import__("random").Random(3)

def second_interrupt(after):
    """A trace function raising KeyboardInterrupt at the after-th line run in extsrc."""
    count = [0]
    def trace(frame, event, arg):
        if not frame.f_code.co_filename.startswith(EXTSRC):
            return None
        if event in ("call", "line"):
            count[0] += 1
            if count[0] == after:
                sys.settrace(None)
                frame.f_trace = None
                landed[0] += 1
                raise KeyboardInterrupt("second")
        return trace
    return trace

def on_sigint(signum, frame):
    if frame is not None and frame.f_globals is globals():
        return  # in the test's loop itself: see the module doc
    landed[0] += 1
    sys.settrace(None)
    if rng.random() < 0.5:
        trace = second_interrupt(rng.randint(1, 30))
        sys.settrace(trace)
        f = frame
        while f is not None:  # the frames running now get their lines traced too
            if f.f_code.co_filename.startswith(EXTSRC):
                f.f_trace = trace
            f = f.f_back
    raise KeyboardInterrupt("storm")

SENDER = """
import os, random, signal, sys, time
pid, rng = int(sys.argv[1]), random.Random(int(sys.argv[2]))
while True:
    time.sleep(rng.uniform(0, 0.0008))
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        break
"""


import torch
from extsrc.torch import TorchLoader
from sources import StopsAt
src = extsrc.ParallelSource(StopsAt(96), 4, num_workers=2)
loader = TorchLoader(src)
EXPECTED = list(range(0, 96, 4))
make_iterator = lambda: iter(loader)
first_of = lambda batch: int(batch[0, 0])
close = loader.close


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
sender = subprocess.Popen([sys.executable, "-c", SENDER, str(os.getpid()), "3"])
epochs = 0
try:
    while landed[0] < WANTED:
        seen = one_epoch(make_iterator, EXPECTED)
        got = [first_of(b) for b in seen]
        assert got == EXPECTED, (epochs, landed[0], got)
        epochs += 1
finally:
    sys.settrace(None)
    sender.kill()
    sender.wait()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
close()
print("landed", landed[0], "epochs", epochs)
