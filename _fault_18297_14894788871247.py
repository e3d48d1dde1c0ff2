
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

import aiohttp  # imported before the fork: the first batch does not wait for the import
import numpy as np
import extsrc
from extsrc.bench.object_server import ObjectServer
from extsrc.bench.remote_clients import BlockingHttpObjects

class HangAt(BlockingHttpObjects):
    def _target(self, info):
        target = super()._target(info)
        return target.replace("/objects/", "/hang/") if info.idx_in_epoch == 21 else target

def run(report):
    with ObjectServer(size=1000) as server:
        with extsrc.ParallelSource(HangAt(server.url), 8, num_workers=2, concurrency=8,
                                   timeout=8) as source:
            source.start()
            report.pids(source.worker_pids())
            report.fault_starts()
            for _ in source:
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
