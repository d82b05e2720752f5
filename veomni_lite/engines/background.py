"""`BackgroundEngine`: an engine that makes no collective (the embedded one) behind one worker thread, so rollouts
generate while the trainer trains (`rl.async_steps` >= 1, `veomni_lite.rl.rollout_batch`).

The worker runs its jobs in the order they were given: `start_generate` queues a generation and returns at once,
`finish_generate` waits for the oldest one still queued, `sync_weights` queues a load of a private copy of the weights
(the trainer keeps updating its own) and `generate` queues one and waits. So a generation uses the weights of the
last `sync_weights` given before it, however late the worker runs it, and each rank's engine runs alike. The worker
makes no collective; an error of a job is raised by the `finish_generate` or `generate` that collects it (the
rollout queue agrees on it: a `GenerationError` on every rank).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

from veomni_lite.engines.base import Rollout, RolloutEngine, RolloutRequest, SamplingSettings

__all__ = ["BackgroundEngine", "GenerationError"]

T = TypeVar("T")


class GenerationError(RuntimeError):
    """A generation collected from the engine's queue failed on some rank (raised on every rank alike)."""


class BackgroundEngine(RolloutEngine):
    """`engine` (no collective) run by one worker thread (module docstring); `rank`: this rank's index in the
    request lists `start_generate` takes (every rank's requests, as the vLLM engine takes them)."""

    def __init__(self, engine: RolloutEngine, rank: int = 0) -> None:
        self.engine, self.rank = engine, rank
        self.name = engine.name
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="rollout-engine")
        self._pending: deque[Future[list[list[Rollout]]]] = deque()
        self._last_sync: Future[None] | None = None

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Queue `fn` on the worker, after every job given before it (e.g. pinning the worker to a core)."""
        return self._worker.submit(fn)

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Queued: the generations started before it keep the weights they started with; a bad key is raised by the
        `generate` or `finish_generate` of the next generation."""
        copy = {key: value.detach().clone() for key, value in state_dict.items()}
        self._last_sync = self.call(lambda: self.engine.sync_weights(copy, version))
        self._version = version

    def _queue_generate(
        self, requests: Sequence[RolloutRequest], settings: SamplingSettings
    ) -> Future[list[list[Rollout]]]:
        """A generation queued: on the worker, the error of the sync before it first (it has run), then the job."""
        sync = self._last_sync

        def job() -> list[list[Rollout]]:
            if sync is not None:
                sync.result()
            return self.engine.generate(requests, settings)

        return self.call(job)

    def generate(self, requests: Sequence[RolloutRequest], settings: SamplingSettings) -> list[list[Rollout]]:
        """Queued after every job before it, waited for."""
        return self._queue_generate(requests, settings).result()

    def start_generate(self, everyone: Sequence[Sequence[RolloutRequest]], settings: SamplingSettings) -> None:
        """Not collective: this rank's requests (`everyone[rank]`) queued; `finish_generate` collects them."""
        requests = list(everyone[self.rank])
        self._pending.append(self._queue_generate(requests, settings))

    def finish_generate(self) -> list[list[Rollout]]:
        """The rollouts of the oldest generation `start_generate` queued (waiting for it)."""
        return self._pending.popleft().result()

    @property
    def pending(self) -> int:
        """Generations started and not yet finished."""
        return len(self._pending)

    def close(self) -> None:
        """Stop the worker (a job running finishes, queued ones are dropped) and close the engine."""
        self._pending.clear()
        self._worker.shutdown(wait=True, cancel_futures=True)
        self.engine.close()
