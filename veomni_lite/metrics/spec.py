"""Metric declarations: a name, how a logging window reduces it, and how it is displayed.

Reductions over one logging window, across all ranks:
- `mean`: sum of (value * count) / sum of count, so the window is weighted by what each record covered.
- `sum`: sum of the recorded values.
- `min` / `max`: the smallest / largest recorded value.
- `last`: each rank's last recorded value in the window, averaged over the ranks that recorded one. Meant for
  values that are the same on every rank (learning rate, a global grad norm), where that average is the value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

REDUCTIONS = ("mean", "sum", "min", "max", "last")


@dataclass(frozen=True)
class MetricSpec:
    """One declared metric.

    `fmt` is a `format()` spec for the console (".4f" for losses, ".1e" for a learning rate). `sp_dedup=True` marks
    a value that every rank of a sequence-parallel group records identically (samples, tokens seen): only
    sp_rank 0 of each group contributes it to the reduction, so it is not counted sp_size times.
    """

    name: str
    reduce: str
    fmt: str = ".4f"
    sp_dedup: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("MetricSpec: name must be a non-empty string")
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"MetricSpec {self.name!r}: unknown reduce {self.reduce!r}; expected one of {REDUCTIONS}")
        try:
            format(1.0, self.fmt)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"MetricSpec {self.name!r}: fmt {self.fmt!r} cannot format a float ({exc})") from exc

    def format(self, value: float) -> str:
        """`value` rendered with this spec's fmt."""
        return format_value(value, self.fmt)


def format_value(value: int | float, fmt: str | None = None) -> str:
    """Render a scalar with `fmt`; without one (or when it does not apply) pick a readable default.

    The default keeps small and large magnitudes visible: 0.0001 renders as "1.000e-04", never as "0.0001"
    rounded to "0.0000".
    """
    if fmt is not None:
        try:
            return format(value, fmt)
        except (ValueError, TypeError):
            pass
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value) or value == 0.0:
        return str(value)
    if 1e-3 <= abs(value) < 1e5:
        return f"{value:.4f}"
    return f"{value:.3e}"
