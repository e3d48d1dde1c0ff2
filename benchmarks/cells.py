"""A cell: one loader on one workload, in a fresh interpreter; its figures as one JSON line.

Throughput cells run as ``job.py`` scripts that call :func:`benchmarks.cell_job.cell_main`;
startup cells are a user's job written out as a script (:func:`startup_script`),
because with spawn each worker imports the main script again, which
``python -c`` would skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

from benchmarks.loaders import (
    DALI, DALI_THREADS, EXTSRC_DALI, STARTUP_WORKERS, WORKERS, Opened, expected_indices, open_loader,
)
from benchmarks.measure import measure
from benchmarks.ray_bench import RAY_LOADERS, open_ray_loader
from benchmarks.workloads import ALL_WORKLOADS

RESULT_MARK = "EXTSRC-BENCH-RESULT "
MB = 1e6  # MB/s figures are in 10^6 bytes per second

_CELL_CODE = """\
import sys
from benchmarks.cell_job import cell_main

if __name__ == "__main__":
    sys.exit(cell_main(sys.argv[1:]))
"""

def open_cell_loader(loader: str, workload: str, consumed: bool = False) -> Opened:
    """``loader`` on ``workload`` as every cell opens it (its workers, fork)."""
    if loader in RAY_LOADERS:
        return open_ray_loader(loader, workload, WORKERS)
    return open_loader(loader, workload, WORKERS, "fork", consumed)

def throughput_cell(loader: str, workload: str, seconds: float, warmup_s: float,
                    consumed: bool = False) -> Dict[str, Any]:
    """Figures of ``loader`` on ``workload``: batches taken for ``seconds`` after ``warmup_s``."""
    w = ALL_WORKLOADS[workload]
    take, indices, close = open_cell_loader(loader, workload, consumed)
    try:
        batches, elapsed, cpu, total, last = measure(take, seconds, warmup_s)
        extra = take.figures() if hasattr(take, "figures") else {}  # a loader's own figures
        got = indices(last)
        expected = expected_indices(loader, total - 1, w.batch_size, w.epoch_batches)
        if got != expected:
            raise RuntimeError(f"{loader}: batch {total - 1} holds samples {got[:4]}..., "
                               f"expected {expected[:4]}...")
    finally:
        close()
    samples_per_s = batches * w.batch_size / elapsed
    if "faults" in cpu:
        cpu["faults_per_sample"] = cpu.pop("faults") / (batches * w.batch_size)
    result = {
        "batches": batches,
        "elapsed_s": elapsed,
        "samples_per_s": samples_per_s,
        "mb_per_s": samples_per_s * w.sample_bytes / MB,
        **cpu,  # cores: consumer_cpu (consuming process), loader_cpu (it and its workers), other_cpu
        **extra,
    }
    if "consumer_cpu" in cpu:  # the training process's CPU per batch, all its threads
        result["consumer_ms_per_batch"] = cpu["consumer_cpu"] * elapsed / batches * 1e3
    if w.spin_s:
        result["ideal_fraction"] = samples_per_s / (WORKERS / w.spin_s)
    return result

_STARTUP_SCRIPT = """\
import json, time
from {module} import fn, pipeline_def
from benchmarks.cells import RESULT_MARK
from benchmarks.loaders import dali_indices
from benchmarks.measure import CpuMeter
from benchmarks.workloads import ALL_WORKLOADS, CALLBACKS

@pipeline_def(batch_size=ALL_WORKLOADS[{workload!r}].batch_size, num_threads={threads}, device_id=None,
              py_num_workers={workers}, py_start_method="spawn")
def pipeline():
    return fn.external_source(source=CALLBACKS[{workload!r}], batch=False, parallel=True)

if __name__ == "__main__":
    meter = CpuMeter()
    defined = time.perf_counter()
    pipe = pipeline()
    built = time.perf_counter()
    pipe.build()
    (output,) = pipe.run()
    first = time.perf_counter()
    cpu = meter.stop()
    if dali_indices(output) != list(range(ALL_WORKLOADS[{workload!r}].batch_size)):
        raise RuntimeError("the first batch does not hold samples 0, 1, ...")
    print(RESULT_MARK + json.dumps({{"startup_s": first - built, "create_to_first_s": first - defined, **cpu}}),
          flush=True)
"""

def startup_script(loader: str, workload: str) -> str:
    """The script of a startup cell: a user's job from its imports to the first batch."""
    if loader not in (DALI, EXTSRC_DALI):
        raise ValueError(f"no startup cell for {loader!r}")
    module = "extsrc" if loader == EXTSRC_DALI else "nvidia.dali"
    return _STARTUP_SCRIPT.format(module=module, workload=workload, threads=DALI_THREADS,
                                  workers=STARTUP_WORKERS)

def memory_cell(loader: str, workload: str, seconds: float, warmup_s: float) -> Dict[str, Any]:
    """Resident memory of an extsrc loader's workers after a run (VmRSS, bytes, mean of workers)."""
    take, _indices, close = open_cell_loader(loader, workload)
    try:
        measure(take, seconds, warmup_s)
        rss = [_resident_bytes(pid) for pid in take.source.worker_pids()]  # type: ignore[attr-defined]
    finally:
        close()
    return {"worker_rss_bytes": sum(rss) / len(rss)}

def _resident_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

def _import_roots() -> List[str]:
    """The folders that hold ``benchmarks`` and ``extsrc``: a cell's interpreter imports both."""
    import extsrc

    packages = (os.path.abspath(__file__), os.path.abspath(extsrc.__file__))
    return list(dict.fromkeys(os.path.dirname(os.path.dirname(p)) for p in packages))

def run_cell(spec: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    """Runs one cell in a fresh interpreter; its figures, or ``{"error": text}``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*_import_roots(), env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="extsrc-bench-") as folder:
        script = os.path.join(folder, "job.py")
        with open(script, "w") as f:
            f.write(startup_script(spec["loader"], spec["workload"]) if spec.get("kind") == "startup"
                    else _CELL_CODE)
        return _run_script([sys.executable, script, json.dumps(spec)], env, timeout)

def _run_script(command: List[str], env: Dict[str, str], timeout: float) -> Dict[str, Any]:
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,  # so that a stuck cell is killed with all its workers
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except BaseException as exc:
        _kill_group(process)
        process.communicate()
        if isinstance(exc, subprocess.TimeoutExpired):
            return {"error": f"did not finish within {timeout:g} s (killed)"}
        raise
    for line in reversed(out.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    lines = (err or out).strip().splitlines()
    last = lines[-1] if lines else "no output"
    return {"error": f"exit code {process.returncode}: {last}", "stderr": "\n".join(lines[-40:])}

def _kill_group(process: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
