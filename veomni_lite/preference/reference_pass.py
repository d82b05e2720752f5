"""The precomputed DPO / KTO reference (`pref.precompute_reference`): every pair's reference log-probabilities computed
once with the initial weights, before training, into an Arrow cache beside the pairs.

`PrecomputedReference(trainer).compute(pairs, name)` reads `<pair cache>/reference/<fingerprint>/` (keyed by the
weights files, the master dtype and this code; nothing loaded runs code) or computes it: each rank its share of the
pairs, planned as training plans them, every rank running the same count of forwards (FSDP's collectives; agreed in
one all-reduce with any error planning or collating them, before the first forward), published atomically by rank 0
(`sft_cache.build`); then maps it beside the pairs (`PairDataset.attach_reference`).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import torch

from veomni_lite.data import sft_cache
from veomni_lite.data.checks import DataError, data_problem
from veomni_lite.data.packing import plan_micro_batches
from veomni_lite.distributed.collectives import agree, all_gather_objects
from veomni_lite.loss_keys import IGNORE_INDEX, SEQUENCE_IDS
from veomni_lite.preference.losses import PREF_LABELS
from veomni_lite.preference.pairs import PairDataset

logger = logging.getLogger(__name__)

__all__ = ["PrecomputedReference"]


class PrecomputedReference:
    """The precomputed reference of `trainer` (a `PreferenceTrainer`: its model, collate, layout and control group)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def key(self) -> dict[str, Any]:
        """What the precomputed reference depends on beyond its pairs (whose cache directory it lives in): the model
        directory's weights files (name, size, mtime), the master dtype and this code."""
        t = self.trainer
        directory = Path(t.config.model.pretrained_dir)
        weights = sorted(p for pattern in ("*.safetensors", "*.bin") for p in directory.glob(pattern))
        return {
            "version": sft_cache.CACHE_VERSION,
            "code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
            "weights": [str(directory.resolve()), [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in weights]],
            "master_dtype": t.config.parallel.master_dtype,
        }

    def compute(self, pairs: PairDataset, name: str) -> None:
        """Every pair's reference log-probabilities (collective): read from `<pair cache>/reference/<fingerprint>/`
        (`sft_cache`, Arrow), else computed now with the initial weights and written there (each rank its share of
        the rows, published atomically by rank 0), then mapped beside the pairs (`PairDataset.attach_reference`)."""
        t = self.trainer
        what = f"pref.precompute_reference ({name})"
        directory, found = sft_cache.build(
            pairs.directory / "reference", self.key(), lambda: len(pairs),
            lambda start, stop, path: self.write(pairs, start, stop, path), t.control_group, what,
        )  # fmt: skip
        pairs.attach_reference(directory)
        if t.is_main:
            logger.info("%s: %d pairs %s %s", what, len(pairs), "read from" if found else "computed into", directory)

    def plan(self, pairs: PairDataset, low: int, high: int) -> list[list[list[int]]]:
        """Pairs [low, high) in micro-batches as training plans them, by window (consecutive pairs, in order):
        `train.micro_batch_size` pairs each (a window each), or under `data.max_tokens_per_micro_batch` the token
        budget's plan (`plan_micro_batches`, which reorders a window's pairs) of each window of the pairs one rank
        holds in a step (global batch / dp), which bounds the planner's cost as in training."""
        t = self.trainer
        budget = t.config.data.max_tokens_per_micro_batch
        if not budget:
            size = t.config.train.micro_batch_size
            return [[list(range(i, min(i + size, high)))] for i in range(low, high, size)]
        window = max(t.config.train.global_batch_size // t.parallel.dp_size, 1)
        lengths = pairs.lengths()
        plan = []
        for first in range(low, high, window):
            last = min(first + window, high)
            where = f"pref.precompute_reference, pairs [{first}, {last}): "
            cut = plan_micro_batches(lengths[first:last].tolist(), budget, t.config.data.packing, where)
            plan.append([[first + j for j in micro_batch] for micro_batch in cut])
        return plan

    def check(self, pairs: PairDataset, micro_batches: list[list[int]]) -> Exception | str | None:
        """This rank's problem preparing the pass's micro-batches (pair indices each), or None: each collated and
        SP-sliced once before any forward and dropped (the pass may cover a whole split, too much to hold), so that
        an error only this rank meets (a pair that does not collate) is agreed with the plan, in its one
        all-reduce, instead of leaving the other ranks waiting in a forward's collectives. Costs a second collate
        of every micro-batch (host work, small beside its forward)."""
        t = self.trainer
        try:
            for members in micro_batches:
                t.shard(t.collate([pairs[i] for i in members]))
        except Exception as exc:  # noqa: BLE001 - agreed by the caller, then raised on every rank
            return data_problem(exc, f"rank {t.rank}: pref.precompute_reference: ")
        return None

    @torch.no_grad()
    def write(self, pairs: PairDataset, start: int, stop: int, path: Path) -> dict[str, int]:
        """The reference log-probabilities of pairs [start, stop) (this rank's share of `sft_cache.build`) into the
        Arrow file `path`, in pair order, a window at a time as they are computed. The ranks of an SP group
        (consecutive ranks: rank = dp_rank x sp_size + sp_rank) run the forwards of their dp share of the pairs
        together, micro-batch by micro-batch (planned as training plans them, `plan`), and every rank runs
        the same number of forwards, the most any rank planned (FSDP's collectives; agreed in one all-reduce that also
        agrees a planning or collate error, `check`): a shorter plan is padded with forwards of one pair whose values
        are dropped, and a
        rank whose file write fails runs its remaining forwards before `sft_cache.build` agrees the error. Each rank
        keeps the pairs of its own share."""
        t = self.trainer
        import pyarrow as pa

        count = len(pairs)
        dp, dp_rank = t.parallel.dp_size, t.parallel.dp_rank
        low, high = count * dp_rank // dp, count * (dp_rank + 1) // dp
        assert low <= start <= stop <= high, "an SP group's ranks share its dp share of the rows"
        windows: list[list[list[int]]] = []
        problem: DataError | None = None
        try:
            windows = self.plan(pairs, low, high)
        except DataError as exc:
            problem = exc
        plan = [(w, members) for w, window in enumerate(windows) for members in window]
        padding = [low if low < high else 0]  # the one pair of a padding forward, dropped
        problem = problem or self.check(pairs, [members for _, members in plan] + [padding])
        (rounds,) = agree(problem, DataError, t.control_group, [len(plan)], "pref.precompute_reference: ")
        written = {"samples": 0}
        schema = pa.schema([("ref_chosen", pa.large_list(pa.float64())), ("ref_rejected", pa.large_list(pa.float64()))])

        def batches() -> Any:
            pending: dict[int, tuple[list[float], list[float]]] = {}  # this window's pairs of this rank's share
            for round_ in range(rounds):
                real = round_ < len(plan)
                members = plan[round_][1] if real else padding
                whole = t.collate([pairs[i] for i in members])
                batch = t.preforward(t.shard(whole))
                logp = t.model_output(batch).double().cpu()
                if t.parallel.sp_size > 1:
                    shards = all_gather_objects(logp, t.parallel.sp_group)
                    logp = torch.cat(shards, dim=1)[:, : whole["input_ids"].shape[1]]
                if not real:
                    continue
                ids, valid = whole[SEQUENCE_IDS], whole[PREF_LABELS] != IGNORE_INDEX
                for p, i in enumerate(members):
                    if start <= i < stop:
                        pending[i] = (logp[(ids == 2 * p) & valid].tolist(), logp[(ids == 2 * p + 1) & valid].tolist())
                window_done = round_ + 1 == len(plan) or plan[round_ + 1][0] != plan[round_][0]
                if window_done and pending:
                    order = sorted(pending)
                    written["samples"] += len(order)
                    yield {"ref_chosen": [pending[i][0] for i in order], "ref_rejected": [pending[i][1] for i in order]}
                    pending = {}

        was_training = t.model.training
        t.model.eval()
        produced = batches()
        try:
            sft_cache.write_batches(path, schema, produced)
        finally:
            for _ in produced:  # a write that failed here: the forwards left still run on every rank
                pass
            t.model.train(was_training)
        return written
