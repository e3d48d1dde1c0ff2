"""The entry point of a cell's own process: run the cell its spec names, print its figures.

:func:`benchmarks.cells.run_cell` starts a ``job.py`` script that calls
:func:`cell_main`; the kinds of cell that other modules measure (images,
transfers, remote objects) are imported from here, so that those modules can
use :mod:`benchmarks.cells` to start their cells.
"""

from __future__ import annotations

import json
from typing import Sequence

from benchmarks.cells import RESULT_MARK, memory_cell, throughput_cell


def cell_main(argv: Sequence[str]) -> int:
    """Runs the cell of the JSON spec ``argv[0]``; prints its figures as one line after ``RESULT_MARK``."""
    spec = json.loads(argv[0])
    if spec.get("kind") == "images":
        from benchmarks.image_loaders import image_cell

        result = image_cell({k: v for k, v in spec.items() if k != "kind"})
    elif spec.get("kind") == "h2d":
        from benchmarks.transfer import transfer_cell

        result = transfer_cell({k: v for k, v in spec.items() if k != "kind"})
    elif spec.get("kind") == "remote":
        from benchmarks.remote import remote_cell

        result = remote_cell(spec)
    elif spec.get("kind") == "step":
        from benchmarks.step import step_cell

        result = step_cell(spec["loader"], spec["workload"], spec["seconds"], spec["warmup_s"])
    elif spec.get("kind") == "memory":
        result = memory_cell(spec["loader"], spec["workload"], spec["seconds"], spec["warmup_s"])
    else:
        result = throughput_cell(spec["loader"], spec["workload"], spec["seconds"], spec["warmup_s"],
                                 spec.get("consumed", False))
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0
