"""What a sink can log: scalars. Everything else is skipped with one warning per key.

A scalar is a Python/NumPy int or float (bool counts as int; NaN and inf are floats), or a tensor/array with exactly
one element. Lists, dicts, tables, histogram tensors, None and complex numbers are not scalars.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Mapping

import torch

logger = logging.getLogger(__name__)

Scalar = int | float


def as_scalar(value: object) -> Scalar | None:
    """`value` as a Python int/float, or None when it is not a scalar. Reads a one-element tensor to the host."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            return None
        return as_scalar(value.detach().reshape(()).item())
    size = getattr(value, "size", None)
    if isinstance(size, int) and size == 1 and callable(getattr(value, "item", None)):
        return as_scalar(value.item())  # a one-element NumPy array
    return None


def split_scalars(values: Mapping[str, object], warned: set[str] | None) -> dict[str, Scalar]:
    """The scalar entries of `values`, in order, as Python numbers.

    A non-scalar entry is dropped; the first time a key is dropped a warning names it and the key is added to
    `warned`, so each key warns once per `warned` set. `warned=None` drops silently (non-main ranks).
    """
    scalars: dict[str, Scalar] = {}
    for key, value in values.items():
        scalar = as_scalar(value)
        if scalar is not None:
            scalars[key] = scalar
            continue
        if warned is not None and key not in warned:
            warned.add(key)
            logger.warning(
                "metrics: skipping %r: a %s is not a scalar (further values of this key are skipped silently)",
                key,
                type(value).__name__,
            )
    return scalars
