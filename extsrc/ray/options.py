"""The Ray backend's options (``ray_options=``), checked once, when the pool is made.

Ray itself is not imported here: the keys and numbers are checked by
:func:`check_ray_options`, the rest (``scheduling_strategy`` objects,
``runtime_env``, ``label_selector``) by Ray when the backend is made
(:class:`extsrc.ray.RayBackend`).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from extsrc.engine import non_negative_number

# Ray actor options a pool passes on (ray_options=...): where its actors run and what they hold.
RAY_OPTION_KEYS = ("num_cpus", "num_gpus", "memory", "resources", "accelerator_type",
                   "label_selector", "scheduling_strategy", "runtime_env")
RAY_STRATEGIES = ("DEFAULT", "SPREAD")  # Ray's scheduling strategies given by name
# Actor options the pool sets itself, and why a user's value would break its contract.
RAY_OPTIONS_OWNED = {
    "max_restarts": "a restarted actor would have lost its source's state; the pool replaces a lost "
                    "actor itself within worker_restarts=",
    "max_task_retries": "a retried task would call the callback twice; a dead actor is an error",
    "max_concurrency": "a worker runs its tasks one at a time, in the order sent",
    "concurrency_groups": "a worker runs its tasks one at a time, in the order sent",
    "allow_out_of_order_execution": "a worker runs its tasks one at a time, in the order sent",
    "max_pending_calls": "the pool decides how many tasks each actor holds",
    "name": "the pool's actors are its own and die with close()",
    "namespace": "the pool's actors are its own and die with close()",
    "get_if_exists": "the pool's actors are its own and die with close()",
    "lifetime": "the pool's actors are its own and die with close()",
}


def check_options(start_method: Any, options: Any, names: Tuple[str, str, str],
                  unset: Any) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """``(None, options checked)`` for the Ray backend (see
    :meth:`extsrc.engine.backend.BackendClass.check_options`): Ray actors have no start method."""
    if start_method is not unset:
        raise ValueError(
            f"{names[1]}={start_method!r} chooses how worker processes start "
            f"({names[0]}='processes'); with {names[0]}='ray' the workers are Ray actors: drop it"
        )
    return None, check_ray_options(names[2], options)


def check_ray_options(name: str, value: Any) -> Optional[dict]:
    """A copy of ``value``, Ray actor options for a pool's actors; ``None`` stays ``None``.

    Keys must be among :data:`RAY_OPTION_KEYS`; numbers and resources are
    checked here, the rest (``scheduling_strategy``, ``runtime_env``,
    ``label_selector``) by Ray when the pool is created.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a dict of Ray actor options or None, got {type(value).__name__} "
                        f"{value!r}")
    for key, option in value.items():
        where = f"{name}[{key!r}]"
        if key in RAY_OPTIONS_OWNED:
            raise ValueError(f"{where}: extsrc sets this Ray option itself ({RAY_OPTIONS_OWNED[key]})")
        if key not in RAY_OPTION_KEYS:
            raise ValueError(f"{where}: not an option extsrc passes to its Ray actors; expected one of "
                             f"{RAY_OPTION_KEYS}")
        if key in ("num_cpus", "num_gpus", "memory"):
            non_negative_number(where, option)
        elif key == "resources":
            if not isinstance(option, dict):
                raise TypeError(f"{where} must be a dict of resource name to amount, got {option!r}")
            for resource, amount in option.items():
                if not isinstance(resource, str):
                    raise TypeError(f"{where}: resource names are str, got {resource!r}")
                non_negative_number(f"{where}[{resource!r}]", amount)
        elif key in ("runtime_env", "label_selector") and not isinstance(option, dict):
            raise TypeError(f"{where} must be a dict, got {type(option).__name__} {option!r}")
        elif key == "accelerator_type" and not isinstance(option, str):
            raise TypeError(f"{where} must be a str, got {option!r}")
        elif key == "scheduling_strategy" and isinstance(option, str) and option not in RAY_STRATEGIES:
            raise ValueError(f"{where} must be one of {RAY_STRATEGIES} or a Ray scheduling strategy "
                             f"object, got {option!r}")
    return dict(value)
