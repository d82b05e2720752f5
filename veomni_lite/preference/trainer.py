"""Preference training on the one train loop: `PreferenceTrainer` (DPO family, ORPO, KTO, Bradley-Terry reward models).

An `SFTTrainer` whose samples are pairs (`veomni_lite.preference.pairs`, `data.format: preference`), collated by
`collate_pairs` (padded or packed, under `train.micro_batch_size` or the token budget) and SP-sliced like any batch;
`forward` turns the model's token log-probabilities (fused with its LM head; a reward model's scores) into the `pref`
head (`PreferenceLoss`), whose mode is `seq-mean-token-sum` over pairs, so `LossStep` + `mean_global_loss` make every
step exactly the mean over its pairs on all ranks (one loss all-reduce per step). The reference of sigmoid / ipo / hinge
is the initial weights (`ReferenceWeights`: this rank's shards cloned, or under LoRA the adapters off), run on the same
micro-batch before the policy's forward, or with `pref.precompute_reference` computed once before training, each rank a
share of the pairs, into an Arrow cache inside the pair cache's directory (`<pair cache>/reference/<fingerprint>/`,
keyed by the weights files and the master dtype; reused by a later run or a resume, read memory-mapped, nothing loaded
runs code). The pairs themselves are preprocessed once into `data.cache_dir` (`PairDataset`) and read memory-mapped.
KTO's reference point z0 is the whole step's KL estimate: every train and eval step (`_loss_step`) runs `kto_pass`
over all of the step's micro-batches first (reference and no-grad policy forwards, one all-reduce), then the loss pass.
Metrics (TRL's names, pair-weighted over micro-batches, ranks and the log window) and `eval/...` the same on
`data.eval_path`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from veomni_lite.data.checks import DataError
from veomni_lite.data.sft import read_sources
from veomni_lite.distributed.collectives import agree
from veomni_lite.distributed.sequence_parallel import slice_micro_batch
from veomni_lite.loss_keys import is_labels_key
from veomni_lite.metrics.accumulator import MetricSpec
from veomni_lite.models.heads import LogprobRequest
from veomni_lite.models.hf_reward_model import HFRewardModel
from veomni_lite.models.pretrained import read_model_directory
from veomni_lite.models.registry import DTYPES
from veomni_lite.plain_loop import LossStep
from veomni_lite.post_training import ReferenceWeights
from veomni_lite.preference.config import PrefConfig
from veomni_lite.preference.losses import (
    KL,
    PREF,
    PREF_LABELS,
    PREF_MODE,
    REF_LOGPROBS,
    PreferenceLoss,
    kto_kl_totals,
    kto_reference_point,
    metric_differences,
    metric_names,
)
from veomni_lite.preference.pairs import PairDataset, PairEncoder, collate_pairs
from veomni_lite.preference.reference_pass import PrecomputedReference
from veomni_lite.trainer.sft import SFTTrainer, cache_dir

logger = logging.getLogger(__name__)

__all__ = ["PreferenceTrainer"]


class PreferenceTrainer(SFTTrainer):
    """See the module docstring. `config.pref` is the `pref` section (`PrefConfig`)."""

    evaluates_starting_weights = True

    def __init__(self, config: Any) -> None:
        self.pref: PrefConfig = config.pref
        self.head = PreferenceLoss.of(self.pref)
        self.reference: ReferenceWeights | None = None
        self._z0 = torch.zeros((), dtype=torch.float64)  # kto: the reference point of the step (`kto_pass`)
        config.loss.modes = {**config.loss.modes, PREF: PREF_MODE}  # the head is a mean over pairs (see the module)
        super().__init__(config)

    # ------------------------------------------------------------------ data

    def build_datasets(self) -> tuple[Any, Any | None]:
        """The pairs of `data.train_path` and `data.eval_path` (evaluation on when `train.eval_interval` and
        `train.eval_batches` are set) through the cache (`data.cache_dir`), each rank encoding a share on a miss; an
        input error on any rank is a DataError on every rank, naming the row."""
        problem: Exception | None = None
        try:
            self._read_model_inputs()
        except (DataError, ValueError) as exc:
            problem = exc
        agree(problem, DataError, self.control_group, where="preference data: ")
        data, train = self.config.data, self.config.train
        splits = {"data.train_path": data.train_path}
        if data.eval_path and train.eval_interval and train.eval_batches:
            splits["data.eval_path"] = data.eval_path
        built: dict[str, PairDataset] = {}
        for key, spec in splits.items():
            sources: list = []
            problem = None
            try:
                sources = read_sources(spec, key)
            except DataError as exc:
                problem = exc
            agree(problem, DataError, self.control_group, where=f"{key}: ")
            rows = PairEncoder(
                sources, self.encoder, data.columns, data.max_seq_len, data.overlength, data.media_dir, self.images,
                data.max_tokens_per_micro_batch, data.packing, not self.head.paired,
            )  # fmt: skip
            pairs = PairDataset(rows, cache_dir(self.config), self.control_group, key)
            if self.is_main:
                found = "read from" if pairs.found else "preprocessed into"
                logger.info("preference data: %s: %s (%s %s)", key, pairs.summary(), found, pairs.directory)
            built[key] = pairs
        self.train_pairs, self.eval_pairs = built["data.train_path"], built.get("data.eval_path")
        if len(self.train_pairs) < train.global_batch_size:
            raise DataError(f"data.train_path: {len(self.train_pairs)} pairs, fewer than train.global_batch_size")
        if self.eval_pairs is not None and len(self.eval_pairs) < train.global_batch_size:
            raise DataError(f"data.eval_path: {len(self.eval_pairs)} pairs, fewer than one eval batch")
        return self.train_pairs, self.eval_pairs

    def _read_model_inputs(self) -> None:
        model, data = self.config.model, self.config.data
        if not model.pretrained_dir:
            raise DataError("model.pretrained_dir: preference training needs a local transformers model directory")
        if not data.train_path:
            raise DataError(
                "data.train_path: preference training needs the pairs (a file, a list, a directory or a glob)"
            )
        directory = read_model_directory(model.pretrained_dir, data.chat_template)
        if directory.images is not None and self.head.scores:
            raise DataError(
                f"pref.loss {self.pref.loss}: reward models are causal-LM families here, not vision-language"
            )
        self.model_config, self.tokenizer, self.encoder = directory.config, directory.tokenizer, directory.encoder
        self.images = directory.images

    def collate(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        """Pairs -> one micro-batch of their sides (`collate_pairs` over the model's SFT collate)."""
        return collate_pairs(samples, super().collate, self.head.scores)

    @property
    def label_limits(self) -> dict[str, int]:
        return {PREF_LABELS: self.vocab_size}

    # ------------------------------------------------------------------ model

    @property
    def _sharded_build(self) -> bool:
        """A reward model's new score head is seeded on rank 0 and scattered: never read shard by shard."""
        return super()._sharded_build and not self.head.scores

    def build_model(self) -> Any:
        if not self.head.scores:
            return super().build_model()
        torch.manual_seed(self.config.train.seed)  # the new score head
        return HFRewardModel.from_pretrained(
            self.config.model.pretrained_dir, DTYPES[self.config.parallel.master_dtype]
        )

    def trained_loss_keys(self, model: Any) -> tuple[str, ...]:
        return (f"{PREF}_loss",)

    def _check_loss_weights(self, model: Any) -> None:
        """The pref head weighs its pairs itself (`PreferenceLoss`)."""

    def on_model_built(self) -> None:
        """The reference: kept as the initial weights' shards, or computed now for every pair (precomputed)."""
        if not self.pref.needs_reference:
            return
        if self.pref.precompute_reference:
            for pairs, name in ((self.train_pairs, "train"), (self.eval_pairs, "eval")):
                if pairs is not None:
                    PrecomputedReference(self).compute(pairs, name)
        else:
            self.reference = ReferenceWeights(self.model)

    def shard(self, micro_batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`collate_pairs` marks the pairs (`pref_seq_starts`): only the SP slice here."""
        return slice_micro_batch(micro_batch, self.parallel.sp_rank, self.parallel.sp_size, pad_id=self.pad_id)

    def model_output(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """[B, S]: a reward model's scores, else the log-probability of each `pref_labels` target (the LM head fused
        with them unless `model.fused_lm_head` is false: `LogprobRequest`)."""
        inputs = {k: v for k, v in batch.items() if not is_labels_key(k)}
        if self.head.scores:
            return self.model(**inputs)["scores"]
        return self.model(**inputs, logprobs=LogprobRequest(batch[PREF_LABELS]))["logprobs"]

    def forward(self, micro_batch: Mapping[str, Any]) -> Mapping[str, Any]:
        """The pref head of one micro-batch from the model's output; the live reference's log-probabilities first
        (unless kto's KL pass left them in the micro-batch), kto's reference point z0 of the step (`kto_pass`)."""
        batch = self.preforward(micro_batch)
        if self.reference is not None and REF_LOGPROBS not in batch:
            with torch.no_grad(), self.reference.active():
                batch[REF_LOGPROBS] = self.model_output(batch).double()
        sp_group = self.parallel.sp_group if self.parallel.sp_size > 1 else None
        if self.head.paired:
            return self.head(self.model_output(batch), batch, sp_group)
        batch[KL] = self._z0
        inputs = {k: v for k, v in batch.items() if not is_labels_key(k)}
        outputs = self.model(**inputs, logprobs=LogprobRequest(batch[PREF_LABELS], mean_logits=True))
        return self.head(outputs["logprobs"], batch, sp_group, outputs["mean_logits"])

    @torch.no_grad()
    def kto_pass(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """kto: z0 of the step whose micro-batches (this rank's, SP-sharded) these are, before any loss: every
        micro-batch's reference log-probabilities (kept in it for the loss pass) and a no-grad policy forward, their
        `kto_kl_totals` summed and all-reduced over every rank (`kto_reference_point`). Costs one more policy forward
        (no grad) per micro-batch than DPO; every rank runs its agreed count of micro-batches, as the loss pass."""
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for micro_batch in micro_batches:
            batch = self.preforward(micro_batch)
            if self.reference is not None:
                with self.reference.active():
                    micro_batch[REF_LOGPROBS] = batch[REF_LOGPROBS] = self.model_output(batch).double()
            totals += kto_kl_totals(self.model_output(batch), batch)
        group = self.parallel.world_group if self.parallel.world_size > 1 else None
        self._z0 = kto_reference_point(totals, group)
        return self._z0

    def _loss_step(self, micro_batches: list[dict[str, torch.Tensor]], train: bool) -> LossStep:
        """kto: the KL pass over the whole step first (`kto_pass`), in a train step and an eval step alike."""
        if not self.head.paired:
            self.kto_pass(micro_batches)
        return super()._loss_step(micro_batches, train)

    # ------------------------------------------------------------------ metrics and eval

    @property
    def metric_names(self) -> tuple[str, ...]:
        return metric_names(self.pref.loss)

    @property
    def plots(self) -> dict[str, list[str]]:  # type: ignore[override]
        """`accuracy_curve.png` beside loss_curve.png: the curves the loss registered (the pair accuracy, trained and
        held out; kto: the rewards); none without."""
        curves = list(self.head.entry.extra.get("curves", ()))
        return {"accuracy_curve.png": curves} if curves else {}

    def metric_specs(self) -> list[MetricSpec]:
        return [MetricSpec(name, "mean") for name in self.metric_names]

    @property
    def metric_differences(self) -> dict[str, tuple[str, str]]:
        """Metrics logged as the difference of two recorded means (kto's `rewards/margins`)."""
        return metric_differences(self.pref.loss)

    @property
    def eval_metric_names(self) -> tuple[str, ...]:
        """`eval/<metric>` of every metric the loss records, beside `eval/pref_loss` (pair-weighted)."""
        return self.metric_names

    def extra_eval_metrics(self) -> dict[str, float]:
        """None: SFT's answer accuracy is not a pair's."""
        return {}
