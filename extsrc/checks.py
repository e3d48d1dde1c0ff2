"""Predicates shared by the checks of user arguments (:mod:`extsrc.options`, :mod:`extsrc.order`).

A ``bool`` is never a number here: ``num_workers=True`` is an error, not 1.
"""

from __future__ import annotations

import numbers
from typing import TypeGuard


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer (Python's or NumPy's), and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[float]:
    """Whether ``value`` is a real number (Python's or NumPy's, int or float), and not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
