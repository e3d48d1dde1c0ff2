"""A storm of real SIGINTs during a loop of ``pipe.run()``: no batch lost, none repeated, no hang.

The same storm as ``tests/test_interrupt_storm.py`` (another process sends
SIGINT every few hundred microseconds; half of the interrupts are followed by a
second one raised at a random later call of an extsrc function), on a CPU
pipeline of the DALI drop-in: the loop calls ``pipe.run()`` until
``StopIteration``, then ``pipe.reset()``, and goes on with the same pipeline
after every ``KeyboardInterrupt``. Every epoch must give every batch exactly
once, in order, until 1,000 interrupts have landed outside the test's own code
(in extsrc, or in what it calls and waits for). Runs in its own interpreter
with a time limit, so a hang fails.
"""

import pytest

from faultkit import run_isolated
from test_interrupt_storm import STORM, _check

DALI_PIPELINE = '''
from extsrc import fn, pipeline_def
from sources import StopsAt

@pipeline_def(batch_size=4, py_num_workers=2, num_threads=1, device_id=None)
def storm_pipeline():
    return fn.external_source(StopsAt(96), parallel=True, batch=False)

pipe = storm_pipeline()
pipe.build()

class Runs:
    """pipe.run() until StopIteration (the test's own frame: interrupts landing here are ignored)."""
    def __iter__(self):
        return self
    def __next__(self):
        return pipe.run()

def make_iterator():
    pipe.reset()  # the first epoch: nothing to reset (DALI's reset does nothing before an end)
    return Runs()

EXPECTED = list(range(0, 96, 4))
# C calls only (no library Python frame, where a SIGINT would land outside the loop under test)
first_of = lambda outputs: int(np.asarray(outputs[0][0])[0])
close = pipe.close
'''


@pytest.mark.slow
@pytest.mark.parametrize("seed", [4, 5])
def test_a_storm_of_interrupts_loses_and_repeats_no_batch_of_a_dali_pipeline(seed):
    _check(run_isolated(STORM.format(setup=DALI_PIPELINE, seed=seed, wanted=1000), timeout=300))
