"""Declared metrics, recorded locally and reduced across ranks once per logging window.

Recording is local: totals stay 0-d float64 tensors on the value's device (or Python floats), with no collective and
no host read. A window is {name: [value, weight]}: (total, count) for `mean`, (sum, 1) for `sum`, (last, 1) for
`last`, (extreme, 1) for `min` / `max`. `reduce` is ONE packed SUM (value, weight; a presence flag for min/max) and ONE
packed MAX (max, -min, -inf where a rank has none; led by a fingerprint of the specs), keys in sorted name order, read
to the host once; a key without a value on any rank is omitted, never logged as 0. A controller merges N workers'
windows without torch.distributed: `export_window` (plain data) and `merge_windows` (what the all-reduces would do).
"""

from __future__ import annotations

import math
import numbers
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from veomni_lite.distributed.collectives import all_reduce, collective_device
from veomni_lite.distributed.parallel_state import get_parallel_state

REDUCTIONS = ("mean", "sum", "min", "max", "last")
Value = int | float | torch.Tensor
Window = dict[str, list[Value]]


@dataclass(frozen=True)
class MetricSpec:
    """A metric's name, reduction (`last` averages the ranks' last values, for values they share) and console `fmt`.
    `sp_dedup`: every rank of a sequence-parallel group records the same value (samples); only sp_rank 0 adds it."""

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


def _float64(value: Value, what: str, name: str) -> Value:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"metric {name!r}: {what} must be a scalar; got a tensor of shape {tuple(value.shape)}")
        return value.detach().reshape(()).to(torch.float64, copy=True)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metric {name!r}: {what} must be a number or one-element tensor; got {type(value).__name__}")


def _extreme(a: Value, b: Value, lower: bool) -> Value:
    """min (lower) or max of two values, without a host read."""
    if isinstance(b, torch.Tensor) and not isinstance(a, torch.Tensor):
        a, b = b, a
    if not isinstance(a, torch.Tensor):
        return min(a, b) if lower else max(a, b)
    if isinstance(b, torch.Tensor):
        return (torch.minimum if lower else torch.maximum)(a, b.to(a.device))
    return torch.clamp(a, max=b) if lower else torch.clamp(a, min=b)


def _pack(items: list[Value], device: torch.device) -> torch.Tensor:
    """One float64 buffer on `device`: floats as they are, tensors in one copy per source device, no per-item read."""
    buffer = torch.tensor(
        [0.0 if isinstance(x, torch.Tensor) else x for x in items], dtype=torch.float64, device=device
    )
    by_device: dict[torch.device, list[int]] = {}
    for index, item in enumerate(items):
        if isinstance(item, torch.Tensor):
            by_device.setdefault(item.device, []).append(index)
    for indices in by_device.values():
        buffer[torch.tensor(indices, device=device)] = torch.stack([items[i] for i in indices]).to(device).double()
    return buffer


class MetricAccumulator:
    """Declared metrics, their open window and its reduction over `group` (None: the default group). `sp_rank` (None:
    the parallel state's) decides `sp_dedup`. One thread records; `take_window()` hands a window to another."""

    def __init__(self, specs: Iterable[MetricSpec], group: dist.ProcessGroup | None = None, sp_rank: int | None = None):
        declared = list(specs)
        names = [s.name for s in declared]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"MetricAccumulator: metric names declared more than once: {duplicates}")
        self.specs = tuple(sorted(declared, key=lambda s: s.name))  # packing order, the same on every rank
        self.by_name = {s.name: s for s in declared}  # declaration order: display order
        self.group, self.sp_rank = group, sp_rank
        crc = float(zlib.crc32("\n".join(f"{s.name}\t{s.reduce}\t{int(s.sp_dedup)}" for s in self.specs).encode()))
        self._header = [float(len(self.specs)), -float(len(self.specs)), crc, -crc]
        self._window: Window = {}

    def record(self, name: str, value: Value, count: Value | None = None) -> None:
        """Add a number or one-element tensor (kept on its device) to the open window; `count` weights a `mean`
        metric (default 1), other reductions take none. An undeclared name raises KeyError."""
        spec = self._spec(name)
        if count is not None and spec.reduce != "mean":
            raise ValueError(f"metric {name!r} reduces by {spec.reduce!r}; only 'mean' metrics take a count")
        value = _float64(value, "value", name)
        if spec.reduce == "mean":
            weight = 1.0 if count is None else _float64(count, "count", name)
            self._add(name, value * weight, weight)
            return
        old = self._window.get(name)
        if old is not None and spec.reduce != "last":
            value = old[0] + value if spec.reduce == "sum" else _extreme(old[0], value, spec.reduce == "min")
        self._window[name] = [value, 1.0]

    def record_total(self, name: str, total: Value, count: Value) -> None:
        """Add to `mean` metric `name` a total already weighted by its counts, and their sum (e.g. a step's)."""
        if self._spec(name).reduce != "mean":
            raise ValueError(
                f"metric {name!r} reduces by {self._spec(name).reduce!r}; only 'mean' metrics take a weighted total"
            )
        self._add(name, _float64(total, "total", name), _float64(count, "count", name))

    def _add(self, name: str, total: Value, weight: Value) -> None:
        slot = self._window.setdefault(name, [0.0, 0.0])
        slot[0], slot[1] = slot[0] + total, slot[1] + weight

    def _spec(self, name: str) -> MetricSpec:
        if name not in self.by_name:
            raise KeyError(f"metric {name!r} was not declared; declared metrics: {list(self.by_name)}")
        return self.by_name[name]

    @property
    def is_empty(self) -> bool:
        """Nothing recorded in the open window on this rank."""
        return not self._window

    def take_window(self) -> Window:
        """Hand over the open window and open an empty one."""
        window, self._window = self._window, {}
        return window

    def _contribution(self, window: Window) -> tuple[list[Value], list[Value]]:
        """This rank's SUM and MAX items of `window`, in packing order."""
        sp_rank = self.sp_rank if self.sp_rank is not None else get_parallel_state().sp_rank
        sums: list[Value] = []
        maxes: list[Value] = list(self._header)
        for spec in self.specs:
            slot = None if spec.sp_dedup and sp_rank != 0 else window.get(spec.name)
            if spec.reduce in ("mean", "sum", "last"):
                sums += slot if slot else [0.0, 0.0]
            else:
                sums.append(1.0 if slot else 0.0)
                maxes.append(-math.inf if slot is None else -slot[0] if spec.reduce == "min" else slot[0])
        return sums, maxes

    def _finish(self, sums: list[float], maxes: list[float]) -> dict[str, float]:
        """{name: value} in declaration order from the reduced items; keys without a value omitted."""
        if maxes[:4] != self._header:
            raise RuntimeError(
                "MetricAccumulator: ranks declared different metric specs (every rank must declare the same names, "
                f"reductions and sp_dedup flags); this rank declared {[s.name for s in self.specs]}"
            )
        result: dict[str, float] = {}
        sums_left, maxes_left = iter(sums), iter(maxes[4:])
        for spec in self.specs:
            if spec.reduce in ("mean", "sum", "last"):
                total, weight = next(sums_left), next(sums_left)
                if weight > 0:
                    result[spec.name] = total if spec.reduce == "sum" else total / weight
            else:
                present, extreme = next(sums_left), next(maxes_left)
                if present > 0:
                    result[spec.name] = -extreme if spec.reduce == "min" else extreme
        return {name: result[name] for name in self.by_name if name in result}

    def reduce(self, window: Window | None = None) -> dict[str, float]:
        """Collective on every rank: a window reduced, {name: value} in declaration order. `window=None`: the open
        window, reset only after the reduction succeeded."""
        sums, maxes = self._contribution(self._window if window is None else window)
        device = collective_device(self.group)
        summed = all_reduce(_pack(sums, device), op="sum", group=self.group)
        maxed = all_reduce(_pack(maxes, device), op="max", group=self.group)
        host = torch.cat((summed, maxed)).tolist()  # the one host read of the window
        result = self._finish(host[: len(sums)], host[len(sums) :])
        if window is None:
            self._window = {}
        return result

    def export_window(self, window: Window | None = None) -> dict[str, list[float]]:
        """A worker's share of a window (default: the open one, then reset) as plain lists for `merge_windows`."""
        sums, maxes = self._contribution(self._window if window is None else window)
        if window is None:
            self._window = {}
        return {"sum": _pack(sums, torch.device("cpu")).tolist(), "max": _pack(maxes, torch.device("cpu")).tolist()}

    def merge_windows(self, windows: Iterable[dict[str, list[float]]]) -> dict[str, float]:
        """N workers' exported windows reduced on one process: what `reduce` gives over their ranks."""
        windows = list(windows)
        lengths = {(len(w["sum"]), len(w["max"])) for w in windows}
        if len(lengths) > 1:
            raise RuntimeError(f"MetricAccumulator.merge_windows: windows of different layouts {sorted(lengths)}")
        if not windows:
            return {}
        sums = [math.fsum(items) for items in zip(*(w["sum"] for w in windows))]
        return self._finish(sums, [max(items) for items in zip(*(w["max"] for w in windows))])
