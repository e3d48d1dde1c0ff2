"""extsrc's Ray backend: the workers of a pool as Ray actors, anywhere in a cluster.

Use it through ``ParallelSource(..., backend="ray")``,
``WorkerPool(num_workers, backend="ray")`` or ``pipeline_def(...,
py_backend="ray")``; :class:`RayPool` is the pool they make. Needs
``extsrc[ray]``; Ray itself is imported only when a pool is made.
"""

from extsrc.ray.pool import ActorInfo, RayPool

__all__ = ["ActorInfo", "RayPool"]
