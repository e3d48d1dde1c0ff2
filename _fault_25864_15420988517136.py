
import json, sys, time, traceback
class Report:
    def __init__(self):
        self.worker_pids = []
        self.t0 = None
    def pids(self, pids):
        self.worker_pids = list(pids)
    def fault_starts(self):
        self.t0 = time.monotonic()
report = Report()

import os, signal, sys, time
import numpy as np
import ray
import extsrc

ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

def started(src, report, workers=2):
    """Starts the actors and reports their pids (they must all be gone after the run)."""
    it = iter(src)
    next(it)
    deadline = time.monotonic() + 60
    while len(src.worker_pids()) < workers and time.monotonic() < deadline:
        time.sleep(0.01)
    report.pids(src.worker_pids())
    return it

def run(report):

    def load(info):
        if info.idx_in_epoch >= 8:
            time.sleep(60)
        return np.zeros(2)
    src = extsrc.ParallelSource(load, 4, num_workers=2, backend="ray")
    it = started(src, report)
    report.fault_starts()
    ray.shutdown()
    for _ in it:
        pass

if __name__ == "__main__":
    result = {"type": None, "message": None}
    try:
        run(report)
    except BaseException as exc:
        result = {"type": type(exc).__name__, "message": str(exc),
                  "cause": str(exc.__cause__ or ""), "mro": [c.__name__ for c in type(exc).__mro__],
                  "traceback": traceback.format_exc()}
    result["seconds"] = time.monotonic() - (report.t0 or time.monotonic())
    result["pids"] = report.worker_pids
    print("RESULT " + json.dumps(result), flush=True)
