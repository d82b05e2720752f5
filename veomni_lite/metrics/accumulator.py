"""Local recording of declared metrics and their log-time reduction across ranks.

Recording (`MetricAccumulator.record`) is local: running totals kept as tensors on the value's device (or Python
floats for Python values); no collective, no host read, no Python `bool` of a tensor.

Reduction (`MetricAccumulator.reduce`) runs on every rank of `group` and costs exactly two all-reduces per window:
- ONE packed SUM: (total, count) for `mean`, (sum, 1) for `sum`, (last, 1) for `last`, and a record count for
  `min`/`max`; a rank without a value for a key packs zeros.
- ONE packed MAX: max for `max`, -min for `min` (min = -max(-x)); a rank without a value packs -inf. It also
  carries a fingerprint of the specs, so ranks that declared different metrics get a clear error instead of a
  misaligned result.
Keys are packed in sorted name order. Because every rank declares the same specs, every rank packs the same keys
whatever it recorded, so asymmetric recording needs no extra collective. The reduced values are read to the host
once per window. A key without a value on any rank (for `mean`: a total count of 0) is omitted, never logged as 0.

A controller (the single-controller pattern of Ray-based RL trainers) merges the windows of N workers without
torch.distributed: each worker's `export_window()` is its SUM and MAX items as plain data, and `merge_windows` adds
and maxes them as the two all-reduces would, then finishes exactly as `reduce` does.

`sp_dedup` metrics are contributed by sp_rank 0 of each sequence-parallel group only (exact for integer counters;
no division by sp_size).
"""

from __future__ import annotations

import math
import numbers
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from veomni_lite.distributed.collectives import all_reduce, collective_device
from veomni_lite.distributed.parallel_state import get_parallel_state
from veomni_lite.metrics.spec import MetricSpec

Number = int | float
Value = Number | torch.Tensor


@dataclass
class _Slot:
    """Running state of one metric in one window; each field is a Python float or a 0-d float64 tensor."""

    total: Value = 0.0
    count: Value = 0.0
    low: Value = math.inf
    high: Value = -math.inf
    last: Value = 0.0
    records: int = 0  # record calls: a host-side counter, so presence needs no device read


class MetricWindow:
    """The accumulators of one logging window (one `_Slot` per recorded metric name)."""

    def __init__(self) -> None:
        self.slots: dict[str, _Slot] = {}

    def __bool__(self) -> bool:
        return bool(self.slots)


def _as_float64(value: Value, what: str, name: str) -> Value:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"metric {name!r}: {what} must be a scalar; got a tensor of shape {tuple(value.shape)}")
        return value.detach().reshape(()).to(torch.float64, copy=True)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metric {name!r}: {what} must be a number or one-element tensor; got {type(value).__name__}")


def _minimum(a: Value, b: Value) -> Value:
    if isinstance(a, torch.Tensor):
        return torch.minimum(a, b.to(a.device)) if isinstance(b, torch.Tensor) else torch.clamp(a, max=b)
    return torch.clamp(b, max=a) if isinstance(b, torch.Tensor) else min(a, b)


def _maximum(a: Value, b: Value) -> Value:
    if isinstance(a, torch.Tensor):
        return torch.maximum(a, b.to(a.device)) if isinstance(b, torch.Tensor) else torch.clamp(a, min=b)
    return torch.clamp(b, min=a) if isinstance(b, torch.Tensor) else max(a, b)


def _pack(items: list[Value], device: torch.device) -> torch.Tensor:
    """One float64 buffer on `device` from floats and 0-d tensors: one copy per source device, no per-item read."""
    floats = [0.0 if isinstance(x, torch.Tensor) else x for x in items]
    buffer = torch.tensor(floats, dtype=torch.float64, device=device)
    by_device: dict[torch.device, list[int]] = {}
    for index, item in enumerate(items):
        if isinstance(item, torch.Tensor):
            by_device.setdefault(item.device, []).append(index)
    for indices in by_device.values():
        stacked = torch.stack([items[i] for i in indices]).to(device=device, dtype=torch.float64)
        buffer[torch.tensor(indices, device=device)] = stacked
    return buffer


def _fingerprint(specs: tuple[MetricSpec, ...]) -> float:
    text = "\n".join(f"{s.name}\t{s.reduce}\t{int(s.sp_dedup)}" for s in specs)
    return float(zlib.crc32(text.encode()))  # 32 bits: exact in float64, the same in every process


class MetricAccumulator:
    """Declared metrics, their open window, and the packed cross-rank reduction (see the module docstring).

    `group` is the process group to reduce over; it must hold every rank (None: the default group). `sp_rank`
    overrides the sequence-parallel rank used for `sp_dedup` (None: `get_parallel_state().sp_rank` at reduce time).
    Not thread-safe: one thread records; use `take_window()` to hand a window to another thread for reduction.
    """

    def __init__(
        self,
        specs: Iterable[MetricSpec],
        group: dist.ProcessGroup | None = None,
        sp_rank: int | None = None,
    ) -> None:
        declared = list(specs)
        ordered = tuple(sorted(declared, key=lambda s: s.name))
        names = [s.name for s in ordered]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"MetricAccumulator: metric names declared more than once: {duplicates}")
        self.specs: tuple[MetricSpec, ...] = ordered  # packing order: sorted by name, the same on every rank
        self.by_name: dict[str, MetricSpec] = {s.name: s for s in declared}  # declaration order: display order
        self.group = group
        self.sp_rank = sp_rank
        self._fingerprint = _fingerprint(ordered)
        self._window = MetricWindow()

    # ---- recording: local, no collective, no host read ----

    def record(self, name: str, value: Value, count: Value | None = None) -> None:
        """Add one value of metric `name` to the open window.

        `value` is a Python number or a one-element tensor (kept on its device, detached). `count` weights `mean`
        metrics (default 1: e.g. pass the token count a loss was averaged over); other reductions take no count.
        Raises KeyError for an undeclared name.
        """
        spec = self._spec(name)
        if count is not None and spec.reduce != "mean":
            raise ValueError(f"metric {name!r} reduces by {spec.reduce!r}; only 'mean' metrics take a count")
        value = _as_float64(value, "value", name)
        slot = self._slot(name)
        if spec.reduce == "mean":
            weight = 1.0 if count is None else _as_float64(count, "count", name)
            slot.total = slot.total + value * weight
            slot.count = slot.count + weight
        elif spec.reduce == "sum":
            slot.total = slot.total + value
        elif spec.reduce == "min":
            slot.low = _minimum(slot.low, value)
        elif spec.reduce == "max":
            slot.high = _maximum(slot.high, value)
        else:
            slot.last = value
        slot.records += 1

    def record_total(self, name: str, total: Value, count: Value) -> None:
        """Add to `mean` metric `name` a total already weighted by its counts and the sum of those counts, e.g. a
        step's sum of (local mean x tokens) over its micro-batches and its tokens: one record for many values."""
        spec = self._spec(name)
        if spec.reduce != "mean":
            raise ValueError(f"metric {name!r} reduces by {spec.reduce!r}; only 'mean' metrics take a weighted total")
        slot = self._slot(name)
        slot.total = slot.total + _as_float64(total, "total", name)
        slot.count = slot.count + _as_float64(count, "count", name)
        slot.records += 1

    def _spec(self, name: str) -> MetricSpec:
        spec = self.by_name.get(name)
        if spec is None:
            raise KeyError(f"metric {name!r} was not declared; declared metrics: {list(self.by_name)}")
        return spec

    def _slot(self, name: str) -> _Slot:
        slot = self._window.slots.get(name)
        if slot is None:
            slot = self._window.slots[name] = _Slot()
        return slot

    @property
    def is_empty(self) -> bool:
        """True when nothing was recorded in the open window on this rank (host-side, no device read)."""
        return not self._window

    def recorded_names(self) -> list[str]:
        """The metrics recorded in the open window on this rank."""
        return list(self._window.slots)

    def take_window(self) -> MetricWindow:
        """Hand over the open window and open an empty one (no collective, no read), e.g. to reduce it elsewhere."""
        window, self._window = self._window, MetricWindow()
        return window

    def reset(self) -> None:
        """Drop the open window."""
        self._window = MetricWindow()

    # ---- reduction: every rank of the group, two collectives ----

    def _contribution(self, window: MetricWindow) -> tuple[list[Value], list[Value]]:
        """This rank's (SUM items, MAX items) of `window`, in packing order (see the module docstring)."""
        sp_rank = self.sp_rank if self.sp_rank is not None else get_parallel_state().sp_rank
        n = float(len(self.specs))
        sum_items: list[Value] = []
        max_items: list[Value] = [n, -n, self._fingerprint, -self._fingerprint]
        for spec in self.specs:
            slot = None if spec.sp_dedup and sp_rank != 0 else window.slots.get(spec.name)
            if spec.reduce == "mean":
                sum_items += [slot.total, slot.count] if slot else [0.0, 0.0]
            elif spec.reduce == "sum":
                sum_items += [slot.total, 1.0] if slot else [0.0, 0.0]
            elif spec.reduce == "last":
                sum_items += [slot.last, 1.0] if slot else [0.0, 0.0]
            elif spec.reduce == "min":
                sum_items.append(float(slot.records) if slot else 0.0)
                max_items.append(-slot.low if slot else -math.inf)
            else:
                sum_items.append(float(slot.records) if slot else 0.0)
                max_items.append(slot.high if slot else -math.inf)
        return sum_items, max_items

    def _finish(self, sums: list[float], maxes: list[float]) -> dict[str, float]:
        """{name: value} in declaration order from the reduced SUM and MAX items; keys without a value omitted."""
        n = float(len(self.specs))
        if maxes[:4] != [n, -n, self._fingerprint, -self._fingerprint]:
            raise RuntimeError(
                "MetricAccumulator: ranks declared different metric specs (every rank must declare the same names, "
                f"reductions and sp_dedup flags); this rank declared {[s.name for s in self.specs]}"
            )
        result: dict[str, float] = {}
        si, mi = 0, 4
        for spec in self.specs:
            if spec.reduce in ("mean", "sum", "last"):
                total, weight = sums[si], sums[si + 1]
                si += 2
                if weight > 0:
                    result[spec.name] = total / weight if spec.reduce != "sum" else total
            else:
                present, extreme = sums[si], maxes[mi]
                si += 1
                mi += 1
                if present > 0:
                    result[spec.name] = -extreme if spec.reduce == "min" else extreme
        return {name: result[name] for name in self.by_name if name in result}

    def reduce(self, window: MetricWindow | None = None) -> dict[str, float]:
        """Reduce a window across ranks (collective: every rank must call it); {name: value} in declaration order.

        `window=None` reduces the open window and resets it only after the reduction succeeded; a window from
        `take_window()` is reduced as given. Keys without a value on any rank are omitted.
        """
        own_window = window is None
        sum_items, max_items = self._contribution(self._window if window is None else window)
        device = collective_device(self.group)
        summed = all_reduce(_pack(sum_items, device), op="sum", group=self.group)
        maxed = all_reduce(_pack(max_items, device), op="max", group=self.group)
        host = torch.cat((summed, maxed)).tolist()  # the one host read of the window
        result = self._finish(host[: len(sum_items)], host[len(sum_items) :])
        if own_window:
            self.reset()
        return result

    # ---- a controller's merge: windows as plain data, no torch.distributed ----

    def export_window(self, window: MetricWindow | None = None) -> dict[str, list[float]]:
        """This worker's contribution to a window (default: the open one, which is then reset) as plain data
        (lists of floats, picklable, JSON-able) for `merge_windows` on a controller; one host read."""
        own_window = window is None
        sum_items, max_items = self._contribution(self._window if window is None else window)
        cpu = torch.device("cpu")
        exported = {"sum": _pack(sum_items, cpu).tolist(), "max": _pack(max_items, cpu).tolist()}
        if own_window:
            self.reset()
        return exported

    def merge_windows(self, windows: Iterable[dict[str, list[float]]]) -> dict[str, float]:
        """The reduction of N workers' exported windows, on one process: the SUM and MAX that `reduce` would make
        over their ranks, then the same result (per metric with its declared reduction; empty windows omit keys)."""
        windows = list(windows)
        if not windows:
            return {}
        lengths = {(len(w["sum"]), len(w["max"])) for w in windows}
        if len(lengths) != 1:
            raise RuntimeError(f"MetricAccumulator.merge_windows: windows of different layouts {sorted(lengths)}")
        sums = [math.fsum(items) for items in zip(*(w["sum"] for w in windows))]
        maxes = [max(items) for items in zip(*(w["max"] for w in windows))]
        return self._finish(sums, maxes)

    # ---- checkpointing: this rank's open window ----

    def state_dict(self) -> dict[str, dict[str, float | int]]:
        """This rank's open window as Python numbers (reads device values: call at checkpoint time, not per step)."""
        state: dict[str, dict[str, float | int]] = {}
        for name, slot in self._window.slots.items():
            entry: dict[str, float | int] = {}
            for field in fields(_Slot):
                value = getattr(slot, field.name)
                entry[field.name] = value.item() if isinstance(value, torch.Tensor) else value
            state[name] = entry
        return state

    def load_state_dict(self, state: dict[str, dict[str, float | int]]) -> None:
        """Replace the open window with a saved one; names that are no longer declared raise KeyError."""
        window = MetricWindow()
        for name, entry in state.items():
            if name not in self.by_name:
                raise KeyError(f"saved metric window has undeclared metric {name!r}; declared: {list(self.by_name)}")
            window.slots[name] = _Slot(**{f.name: entry[f.name] for f in fields(_Slot) if f.name in entry})
        self._window = window
