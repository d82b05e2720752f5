"""The durable history of logged values: for each key, a list of {step, epoch, value} in increasing step order."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

SeriesPoint = dict[str, int | float | None]  # {"step": int, "epoch": int | float | None, "value": int | float}


class MetricSeries:
    """Per-key lists of logged points; goes into checkpoints through `state_dict()`.

    Steps count from 1 and increase per key: appending step s drops any earlier point of that key with step >= s,
    so a re-logged or resumed step never appears twice.
    """

    def __init__(self) -> None:
        self._points: dict[str, list[SeriesPoint]] = {}

    def append(self, step: int, epoch: int | float | None, values: Mapping[str, int | float]) -> None:
        """Add one log event's scalar values at `step`."""
        if step < 1:
            raise ValueError(f"MetricSeries: steps count from 1; got step {step}")
        for key, value in values.items():
            points = self._points.setdefault(key, [])
            while points and points[-1]["step"] >= step:
                points.pop()
            points.append({"step": step, "epoch": epoch, "value": value})

    def keys(self) -> list[str]:
        return list(self._points)

    def __getitem__(self, key: str) -> list[SeriesPoint]:
        return self._points[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._points)

    def __contains__(self, key: object) -> bool:
        return key in self._points

    def __len__(self) -> int:
        return len(self._points)

    def last_step(self) -> int:
        """The largest logged step, 0 when empty."""
        return max((points[-1]["step"] for points in self._points.values() if points), default=0)

    def truncate(self, max_step: int) -> None:
        """Drop every point with step > `max_step` (resume from the checkpoint at `max_step`)."""
        for key in list(self._points):
            points = [p for p in self._points[key] if p["step"] <= max_step]
            if points:
                self._points[key] = points
            else:
                del self._points[key]

    def events(self) -> list[dict[str, int | float | None]]:
        """One dict per logged step, {"step", "epoch", key: value, ...}, in step order (rebuilds a JSONL file)."""
        by_step: dict[int, dict[str, int | float | None]] = {}
        for key, points in self._points.items():
            for point in points:
                event = by_step.setdefault(point["step"], {"step": point["step"], "epoch": point["epoch"]})
                event[key] = point["value"]
        return [by_step[step] for step in sorted(by_step)]

    def load_events(self, events: list[Mapping[str, int | float | None]]) -> None:
        """Replace the history with `events()`-shaped rows in step order (as read back from metrics.jsonl)."""
        self._points = {}
        for event in events:
            values = {key: value for key, value in event.items() if key not in ("step", "epoch") and value is not None}
            self.append(int(event["step"]), event.get("epoch"), values)

    def state_dict(self) -> dict[str, list[SeriesPoint]]:
        """A deep copy of the points as plain Python lists/dicts (picklable, no tensors)."""
        return {key: [dict(p) for p in points] for key, points in self._points.items()}

    def load_state_dict(self, state: Mapping[str, list[SeriesPoint]]) -> None:
        """Replace the history with a saved one."""
        self._points = {key: [dict(p) for p in points] for key, points in state.items()}
