"""extsrc's Ray backend: the workers of a pool as Ray actors, anywhere in a cluster.

Use it through ``ParallelSource(..., pool=PoolSpec(backend="ray"))``,
``WorkerPool(num_workers, backend="ray")`` or ``pipeline_def(...,
py_backend="ray")``: the pool finds :class:`RayBackend` by its name
(:mod:`extsrc.engine.backend`) and ``pool.workers_backend`` is it. Needs
``extsrc[ray]``; Ray itself is imported only when a pool is made.
"""

from extsrc.ray.backend import ActorInfo, RayBackend

__all__ = ["ActorInfo", "RayBackend"]
