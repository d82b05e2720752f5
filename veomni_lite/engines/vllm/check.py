"""Whether a server serves the trainer's weights after a sync (`SyncCheck`), from its log-probabilities of a fixed
token sequence (the probe) against the trainer's: pure arithmetic on two lists of numbers, no HTTP."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class SyncCheck:
    """Whether one server serves the trainer's weights after a sync, from its log-probabilities of the probe
    (`engine`) against the trainer's (`trainer`), in a way that holds whatever the engine's precision: a bfloat16
    engine sits 1e-3 to 3e-2 from a float32 trainer, a gap that grows as the weights train, so no fixed tolerance on it
    holds over a long run.

    The first sync: mean |engine - trainer| <= `tolerance` (the server serves the trainer's model). Every later sync
    is compared with an earlier one, its reference: a sync that applies moves the engine's values as it moves the
    trainer's, up to the engine's numeric noise; a skipped one leaves them where they were. So `followed`, the
    projection of the engine's change since the reference onto the trainer's (<dE, dT> / <dT, dT>), is 1 up to
    rms(noise change) / rms(dT) for a sync that applied, and 0 for a skipped one. The check decides only when the
    trainer moved by rms(dT) > `FACTOR` x `noise` (the largest rms |engine - trainer| of a sync that decided), and then
    refuses |followed - 1| > 0.5: a sync that applied is refused only if the engine's noise changed, along the
    trainer's change, by more than twice its largest value so far. The reference is the previous sync when the trainer
    moved far enough since it, else the last sync that decided, so that several small moves add up: a reload that stops
    applying is caught at the first sync whose trainer has moved far enough from the last sync that applied. (A single
    sync skipped amid syncs that apply can pass when the trainer moved too little to tell, its rollouts then sampled by
    the previous weights, within the noise.)"""

    FACTOR = 4.0
    FLOOR = 1e-6  # the noise floor of a float32 engine (measured ~2e-7)

    def __init__(self, tolerance: float) -> None:
        self.tolerance = tolerance
        self.previous: tuple[int, torch.Tensor, torch.Tensor] | None = None  # version, engine, trainer
        self.anchor: tuple[int, torch.Tensor, torch.Tensor] | None = None  # the last sync that decided
        self.noise = 0.0
        self.gap = float("nan")
        """The last sync's mean |engine - trainer|."""
        self.followed: float | None = None
        """The last sync's `followed` (None: it did not decide)."""

    def __call__(self, version: int, engine: Sequence[float], trainer: Sequence[float]) -> str | None:
        """A sync of `version`: None when the server serves the trainer's weights, else what is wrong."""
        if len(engine) != len(trainer):
            return f"the engine gave {len(engine)} probe log-probabilities, the trainer {len(trainer)}"
        e, t = torch.tensor(engine, dtype=torch.float64), torch.tensor(trainer, dtype=torch.float64)
        self.gap, self.followed = (e - t).abs().mean().item(), None
        rms = _rms(e - t)
        if self.previous is None or self.anchor is None:
            if not self.gap <= self.tolerance:
                return (
                    f"at its first sync (version {version}), the engine's log-probabilities of the probe ({len(e)} "
                    f"tokens) differ from the trainer's by mean |diff| {self.gap:.3g} (max "
                    f"{(e - t).abs().max().item():.3g}) > rl.vllm.probe_tolerance {self.tolerance:g}: the engine does "
                    f"not serve the trainer's weights (another model, or a precision far from the trainer's)"
                )
            self.previous = self.anchor = (version, e, t)
            self.noise = rms
            return None
        for reference, e0, t0 in (self.previous, self.anchor):
            moved = _rms(t - t0)
            if moved > self.FACTOR * max(self.noise, self.FLOOR):
                self.followed = torch.dot(e - e0, t - t0).item() / torch.dot(t - t0, t - t0).item()
                if abs(self.followed - 1) > 0.5:
                    return (
                        f"after reloading the weights of version {version}, the engine's log-probabilities of the "
                        f"probe ({len(e)} tokens) changed by rms {_rms(e - e0):.3g} since version {reference}, the "
                        f"trainer's by rms {moved:.3g}: the engine followed {self.followed:.0%} of the trainer's "
                        f"change (a sync that applies follows 100%, up to the engine's numeric noise, rms "
                        f"{self.noise:.2g} so far): the engine does not serve the trainer's weights (a reload that did "
                        f"not apply)"
                    )
                self.anchor, self.noise = (version, e, t), max(self.noise, rms)
                break
        self.previous = (version, e, t)
        return None


def _rms(x: torch.Tensor) -> float:
    return x.pow(2).mean().sqrt().item()
