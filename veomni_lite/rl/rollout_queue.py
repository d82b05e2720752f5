"""Rollouts generated ahead of training with bounded staleness (`rl.async_steps: k`, `rl.partial_rollouts`):
`RolloutQueue`, the prompt blocks in flight on the engine while the trainer trains.

Versions: the policy version of a token is the optimizer steps trained when the weights that sampled it were synced
to the engine (a rollout batch's make, `RolloutPipeline.make`: once per rollout batch of S = `steps_per_rollout`
steps). A sample's staleness is the steps trained when its batch is made minus its oldest token's version
(`rl/staleness/{mean,max}`; per token, in rollout batches, `rl/staleness/hist/{d}`).

The schedule is fixed, so every rank and every rerun decides alike (nothing depends on how fast the engine runs):
when rollout batch t is made (at step tS), block t is taken from the queue (finished now if its generation is still
running), the engine gets the current weights, and blocks t+1 .. t+k are started where not yet in flight: block b is
sampled by the weights of batch max(b - k, 0), the oldest the bound allows, so the engine works up to k batches ahead
(k = 1: today's one-step-async run; k = 0 never uses this queue). A block whose first tokens are more than kS steps
old when taken (a checkpoint of a run with a larger k) is dropped and generated again by the current weights,
counted in `rl/staleness/dropped` (samples).

Partial rollouts (`rl.partial_rollouts`, k >= 2): a block's response tokens are generated in k chunks of
`max_new_tokens` / k positions; chunk 0 starts when the block does and each later one at the next batch's make, by
the weights synced then, continuing every response that has not ended (`RolloutRequest.continued`: its response so
far is part of the prompt, the KV cache recomputed by the new weights); the chunks left when the block is taken run
then. Each token keeps the version and log-probability of the weights that sampled it (`RolloutSample.versions`,
`engine_logprobs`). So a response spans up to k - 1 weight updates and its tokens are 1 to k batches stale (on
average fresher than without). With unchanged weights the chunks sample exactly the whole generation's tokens.

The engine runs the queue in order (`start_generate` / `finish_generate`: the vLLM engine's thread on rank 0, or
`veomni_lite.engines.background.BackgroundEngine` on each rank); results are collected, scored and gathered by the
trainer's thread at a make (collectives), never in the background. A checkpoint first collects every chunk in flight
(`state`, collective), so it holds each block's responses so far with their versions and a resume trains the same
samples (`load`, on any world size).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from veomni_lite.distributed.collectives import agree, all_gather_objects
from veomni_lite.engines.background import GenerationError
from veomni_lite.engines.base import Rollout, RolloutRequest, SamplingSettings
from veomni_lite.rl.rollout_batch import mine, request, samples_of, sync_engine
from veomni_lite.rl.rollouts import RolloutSample

__all__ = ["Flight", "RolloutQueue", "chunk_bounds"]


def chunk_bounds(max_new_tokens: int, chunks: int) -> list[int]:
    """The response positions where chunks start, and the end: chunk c covers [bounds[c], bounds[c + 1])."""
    return [c * max_new_tokens // chunks for c in range(chunks + 1)]


@dataclass
class Flight:
    """A prompt block generating ahead of its batch: `version`, its first tokens' weights; `rows[i][j]`, this rank's
    sample j of prompt i so far (a `Rollout`) and the version of each of its tokens; `chunks`, the chunks started;
    `pending`, whether the last of them is still in the engine's queue; `latest`, that chunk's weights version;
    `taken`, whether its batch has been made from it."""

    block: int
    version: int
    rows: dict[int, list[tuple[Rollout, list[int]]]] = field(default_factory=dict)
    chunks: int = 0
    pending: bool = False
    latest: int = 0
    taken: bool = False


class RolloutQueue:
    """See the module docstring. `async_steps` k and `partial` from the `rl` section; `flights` by block, in the
    order they started; `order`, the blocks whose chunk is in the engine's queue, oldest first."""

    def __init__(self, async_steps: int, partial: bool) -> None:
        self.async_steps = async_steps
        self.chunks = async_steps if partial else 1
        self.flights: dict[int, Flight] = {}
        self.order: deque[int] = deque()

    def take(
        self, context: Any, block: int, prompts: Sequence[Any], settings: SamplingSettings, step: int
    ) -> tuple[list[RolloutSample], int]:
        """This rank's samples of `block` (scored: collective), its remaining chunks generated now, and the samples
        dropped as too stale first (module docstring). `step`: the optimizer steps trained now."""
        dropped = 0
        flight = self.flights.get(block)
        if flight is not None and step - flight.version > self.async_steps * context.steps_per_rollout:
            self._finish_through(context, block)
            dropped = len(prompts) * context.rl.num_generations
            del self.flights[block]
        if block not in self.flights:
            self.start(context, block, prompts, settings, step)
        flight = self.flights[block]
        while True:
            self._finish_through(context, block)
            if not self._continues(context, flight):
                break
            self.start(context, block, prompts, settings, step)
        flight.taken = True  # kept until `advance`: a checkpoint before then holds it, so a resume takes it again
        return self._samples(context, flight, prompts), dropped

    def advance(self, context: Any, blocks: Sequence[int], settings: SamplingSettings, step: int) -> None:
        """After a take, once its batch starts training (by the weights of `step`, synced now): the taken blocks
        leave; under partial rollouts each block in flight continues (its chunk collected, the next started); then
        each of `blocks` not yet in flight starts (its first chunk)."""
        self.flights = {block: flight for block, flight in self.flights.items() if not flight.taken}
        if self.chunks > 1:
            for block in list(self.flights):
                self._finish_through(context, block)
            for block, flight in list(self.flights.items()):
                if self._continues(context, flight):
                    self.start(context, block, self._prompts(context, block), settings, step)
        for block in blocks:
            if block not in self.flights:
                self.start(context, block, self._prompts(context, block), settings, step)

    @staticmethod
    def _prompts(context: Any, block: int) -> Sequence[Any]:
        return context.prompts.batch(block, context.rl.prompts_per_step, context.seed)

    def start(self, context: Any, block: int, prompts: Sequence[Any], settings: SamplingSettings, step: int) -> None:
        """The block's next chunk queued on the engine by the weights of `step` (synced first where they changed);
        its first chunk: every rank's requests, as `generate` makes them; a later one: every response not ended,
        continued (its requests gathered from every rank: collective)."""
        sync_engine(context, step)
        flight = self.flights.setdefault(block, Flight(block, step))
        bounds = chunk_bounds(context.rl.max_new_tokens, self.chunks)
        size = bounds[flight.chunks + 1] - bounds[flight.chunks]
        world, count = context.parallel.world_size, context.rl.num_generations
        if flight.chunks == 0:
            everyone = [
                [request(context, block, i, prompts[i], count) for i in range(r, len(prompts), world)]
                for r in range(world)
            ]
        else:
            everyone = all_gather_objects(self._continuations(context, flight, prompts), context.control_group)
        flight.chunks += 1
        flight.pending, flight.latest = True, step
        self.order.append(block)
        settings = dataclasses.replace(settings, max_new_tokens=size) if self.chunks > 1 else settings
        context.engine.start_generate(everyone, settings)

    def _continuations(self, context: Any, flight: Flight, prompts: Sequence[Any]) -> list[RolloutRequest]:
        """This rank's responses that continue, one request each (prompt + response so far, the sample's seed)."""
        out = []
        for i, row in flight.rows.items():
            base = request(context, flight.block, i, prompts[i], context.rl.num_generations)
            for j, (rollout, _) in enumerate(row):
                if self._open(context, rollout):
                    out.append(RolloutRequest(base.prompt_ids + rollout.response_ids, [base.seeds[j]],
                                              base.model_inputs, {}, len(rollout.response_ids)))  # fmt: skip
        return out

    @staticmethod
    def _open(context: Any, rollout: Rollout) -> bool:
        """A response cut at a chunk's end, not at `max_new_tokens`."""
        return rollout.finish_reason == "length" and len(rollout.response_ids) < context.rl.max_new_tokens

    def _continues(self, context: Any, flight: Flight) -> bool:
        """Whether the block has a chunk left to start (and a response to continue)."""
        if flight.pending or flight.chunks >= self.chunks:
            return False
        return any(self._open(context, r) for row in flight.rows.values() for r, _ in row)

    def _finish_through(self, context: Any, block: int) -> None:
        """Collect the engine's chunks in queue order up to `block`'s (collective where the engine's finish is)."""
        while self.flights[block].pending:
            self._finish(context, self.order.popleft())

    def _finish(self, context: Any, block: int) -> None:
        """The oldest chunk in the engine's queue (`block`'s) merged into its rows."""
        flight = self.flights[block]
        problem, results = None, []
        try:
            results = context.engine.finish_generate()
        except Exception as exc:  # noqa: BLE001 - agreed below: a failure on one rank is every rank's error
            if getattr(exc, "agreed", False):  # the engine's own agreed error (vLLM)
                raise
            problem = exc
        agree(problem, GenerationError, context.control_group, where=f"prompt block {block}: generation: ")
        flight.pending = False
        if flight.chunks == 1:
            indices = mine(context, context.rl.prompts_per_step)
            flight.rows = {
                i: [(r, [flight.version] * len(r.response_ids)) for r in rs] for i, rs in zip(indices, results)
            }
            return
        version = flight.latest
        pieces = iter(result[0] for result in results)
        for row in flight.rows.values():
            for j, (rollout, versions) in enumerate(row):
                if self._open(context, rollout):
                    more = next(pieces)
                    merged = Rollout(rollout.response_ids + more.response_ids, rollout.logprobs + more.logprobs,
                                     more.finish_reason)  # fmt: skip
                    row[j] = (merged, versions + [version] * len(more.response_ids))

    def _samples(self, context: Any, flight: Flight, prompts: Sequence[Any]) -> list[RolloutSample]:
        """This rank's scored samples of a finished flight (collective: the scoring's agreement)."""
        indices = sorted(flight.rows)
        results = [[rollout for rollout, _ in flight.rows[i]] for i in indices]
        samples = samples_of(context, flight.block, prompts, indices, results, flight.version)
        if self.chunks > 1:
            versions = iter(v for i in indices for _, v in flight.rows[i])
            for sample in samples:
                sample.versions = next(versions)
        return samples

    # ------------------------------------------------------------------ checkpoints

    def state(self, context: Any) -> list[dict[str, Any]]:
        """Collective: every chunk in flight collected, then every flight with every rank's rows (plain data, the
        same on every rank)."""
        while self.order:
            self._finish(context, self.order.popleft())
        mine_ = [{b: {i: [(dataclasses.astuple(r), v) for r, v in row] for i, row in f.rows.items()}
                  for b, f in self.flights.items()}]  # fmt: skip
        everyone = all_gather_objects(mine_, context.control_group)
        out = []
        for block, flight in self.flights.items():
            rows = {i: row for rank_rows in everyone for i, row in rank_rows[0][block].items()}
            out.append({"block": block, "version": flight.version, "chunks": flight.chunks, "rows": rows})
        return out

    def load(self, context: Any, state: Sequence[Mapping[str, Any]]) -> None:
        """The flights of `state` (see `state`), each rank keeping its own prompts' rows."""
        self.flights, self.order = {}, deque()
        own = set(mine(context, context.rl.prompts_per_step))
        for saved in state:
            rows = {int(i): [(Rollout(*r), list(v)) for r, v in row] for i, row in saved["rows"].items() if i in own}
            self.flights[int(saved["block"])] = Flight(int(saved["block"]), int(saved["version"]), rows,
                                                       int(saved["chunks"]))  # fmt: skip
        # a taken block comes back untaken: the batch made from it had not trained when the checkpoint was saved
