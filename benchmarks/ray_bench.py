"""``python -m extsrc bench --backend ray``: the Ray backend against worker processes.

Two tables:

* **One host.** ``ParallelSource(..., backend="ray")`` on a local Ray of
  :data:`~benchmarks.loaders.WORKERS` CPUs (``ray.init(num_cpus=2)``, two
  actors) against the process backend (two fork workers), on the three
  workloads. The actors run on the consumer's node, so they write the
  samples into the slots themselves, as worker processes do; the Ray backend
  still pays, per call (up to two batches here), a round trip through Ray
  where the process backend sends one message each way.
* **Two nodes.** The CPU-bound workload on a local two-node cluster
  (``ray.cluster_utils.Cluster``: a head and one more node, one CPU each, one
  actor on each) against the same processes; the figure also gives each
  node's share of the samples.

Ray is imported only inside the cells' own processes.
"""

from __future__ import annotations

from typing import Any, Dict, List

from benchmarks.loaders import EXTSRC, WORKERS, Opened
from benchmarks.tables import Row, Table, Target, workload_label
from benchmarks.workloads import WORKLOADS

EXTSRC_RAY, EXTSRC_RAY_TWO_NODES = "extsrc-ray", "extsrc-ray-two-nodes"
RAY_LOADERS = (EXTSRC_RAY, EXTSRC_RAY_TWO_NODES)
NODE_CPUS = 1  # per node of the two-node cluster: one actor each


def ray_tables() -> List[Table]:
    """The tables of ``--backend ray``."""
    local = Table("ray", f"extsrc backend='ray' (local Ray, {WORKERS} CPUs, {WORKERS} actors) vs "
                  f"backend='processes' ({WORKERS} workers, fork)", "ray", "processes")
    targets = {
        "small": Target("samples_per_s", 0.8),  # a Ray round trip per call of up to 2 batches
        "large": Target("mb_per_s", 0.8),  # written into the slots by the actors: no extra copy
        "cpu": Target("samples_per_s", 0.95),  # the callback's time dwarfs the per-call cost
    }
    local.rows = [Row(workload_label(w), w, EXTSRC_RAY, EXTSRC, targets[w]) for w in WORKLOADS]
    cluster = Table("ray-two-nodes", f"extsrc backend='ray' on a local two-node cluster ({NODE_CPUS} "
                    f"CPU and 1 actor per node) vs backend='processes' ({WORKERS} workers, fork)",
                    "ray, two nodes", "processes")
    cluster.rows = [Row(f"{workload_label('cpu')}, share of samples per node", "cpu", EXTSRC_RAY_TWO_NODES,
                        EXTSRC, Target("samples_per_s", 0.8))]
    return [local, cluster]


def open_ray_loader(loader: str, workload: str, workers: int) -> Opened:
    """Opens a Ray loader (see the module docstring) on ``workload``; like
    :func:`benchmarks.loaders.open_loader`, and ``take.figures()`` gives each node's share."""
    import ray

    import extsrc
    from benchmarks.workloads import CALLBACKS, sample_index

    cluster = None
    if loader == EXTSRC_RAY_TWO_NODES:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": NODE_CPUS})
        for _ in range(workers - 1):
            cluster.add_node(num_cpus=NODE_CPUS)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
    elif loader == EXTSRC_RAY:
        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    else:
        raise ValueError(f"unknown Ray loader {loader!r}")
    source = extsrc.ParallelSource(CALLBACKS[workload], WORKLOADS[workload].batch_size,
                                   pool=extsrc.PoolSpec(num_workers=workers, backend="ray"))
    batches = iter(source)

    def take():
        batch = next(batches)
        batch[0][0]  # the consumer touches one byte
        return batch

    def figures() -> Dict[str, Any]:
        if cluster is None:
            return {}
        actors = source.pool.workers_backend.actors()
        total = sum(a.samples for a in actors) or 1
        shares: Dict[str, float] = {}
        for actor in actors:
            shares[actor.node_id] = shares.get(actor.node_id, 0.0) + actor.samples / total
        return {"node_shares": sorted(shares.values(), reverse=True), "nodes": len(shares)}

    def close():
        source.close()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()

    take.source = source  # type: ignore[attr-defined]
    take.figures = figures  # type: ignore[attr-defined]
    return take, lambda batch: [sample_index(sample) for sample in batch], close
