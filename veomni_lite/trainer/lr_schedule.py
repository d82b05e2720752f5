"""Learning-rate schedules (`optim.schedule`): the multiplier of `optim.lr` each optimizer step trains with.

Each is a pure function of the step index i, counted from 0 (index i is the update logged as step i + 1):
- warmup (every schedule): index i < warmup trains with (i + 1) / warmup, so the last warmup step trains at the peak;
- cosine: then a half-cosine from the peak at index `warmup` down to `min_ratio` at index `max_steps`;
- linear: then a straight line over the same span;
- constant: then the peak;
- wsd (warmup-stable-decay): then the peak until the last `decay_steps` of the run, which decay linearly from the
  peak to `min_ratio` at index `max_steps`.
A decay ends at index `max_steps`, the update after the last (the last step trains just above `min_ratio`), the
convention of transformers' schedules; the warmup never starts at 0, so the first step always trains.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

SCHEDULES = ("cosine", "linear", "constant", "wsd")


def ratio_steps(ratio: float, steps: int) -> int:
    """ceil(ratio x steps), as transformers' Trainer turns a warmup ratio into steps (rounded first, so that
    0.07 x 100 is 7, not 8)."""
    return math.ceil(round(ratio * steps, 9))


def _progress(step: int, start: int, end: int) -> float:
    """How far index `step` is through the decay from `start` to `end`, in [0, 1]."""
    return min(1.0, (step - start) / max(1, end - start))


def cosine(step: int, warmup: int, max_steps: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * _progress(step, warmup, max_steps)))


def linear(step: int, warmup: int, max_steps: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 1 - (1 - min_ratio) * _progress(step, warmup, max_steps)


def constant(step: int, warmup: int, max_steps: int, min_ratio: float) -> float:
    return (step + 1) / warmup if step < warmup else 1.0


def wsd(step: int, warmup: int, max_steps: int, min_ratio: float, decay_steps: int) -> float:
    """The decay starts at index max(warmup, max_steps - decay_steps): it never cuts into the warmup."""
    if step < warmup:
        return (step + 1) / warmup
    start = max(warmup, max_steps - decay_steps)
    return 1.0 if step < start else 1 - (1 - min_ratio) * _progress(step, start, max_steps)


def lr_lambda(
    schedule: str, warmup: int, max_steps: int, min_ratio: float, decay_steps: int = 0
) -> Callable[[int], float]:
    """The multiplier of `schedule` as a function of the step index alone (for `torch.optim.lr_scheduler.LambdaLR`)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule: {schedule!r} is not one of {list(SCHEDULES)}")
    shape = {"cosine": cosine, "linear": linear, "constant": constant}.get(schedule)
    if shape is None:
        shape = functools.partial(wsd, decay_steps=decay_steps)
    return functools.partial(shape, warmup=warmup, max_steps=max_steps, min_ratio=min_ratio)
