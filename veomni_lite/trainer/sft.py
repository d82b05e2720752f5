"""Supervised fine-tuning of any local transformers model on the user's own files, from the config alone.

`model.pretrained_dir` names the model directory (a causal LM, or a vision-language family of
`veomni_lite.models.registry` for images): its config, weights,
tokenizer with its chat template (or `data.chat_template`) and image processor. `data.train_path` / `data.eval_path`
(or `data.eval_fraction` of the rows) name the data, `data.format` and `data.columns` how rows read (see
`veomni_lite.data.sft`), or `data.sources` several weighted ones (`veomni_lite.data.mixture`). The rows are
preprocessed once into `data.cache_dir` (`veomni_lite.data.sft_cache`: the ranks share the rows; a later run or a
resume reads the cache), every row checked, the same error on every rank; the rows truncated or dropped by
`data.overlength` are logged. With `data.streaming` the training files are read while training instead
(`veomni_lite.data.streaming`). Besides the eval losses, `eval/answer_accuracy` is the share of eval
samples whose every trained token the model predicts greedily. `data.packing` and `data.max_tokens_per_micro_batch`
apply (text and the vision-language families). Entry point: `trainers/train_sft.py`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from veomni_lite.data.checks import DataError
from veomni_lite.data.collator import collate
from veomni_lite.data.loader import MicroBatchLoader, epoch_size
from veomni_lite.data.mixture import WeightedMixture, hold_out
from veomni_lite.data.sft import ChatEncoder, override_template, read_sources
from veomni_lite.data.sft_dataset import RowEncoder, SFTDataset
from veomni_lite.data.streaming import SampleStream, StreamingLoader
from veomni_lite.distributed.collectives import agree, all_reduce
from veomni_lite.export import copy_tokenizer_files
from veomni_lite.loss_keys import IGNORE_INDEX, SEQUENCE_IDS, is_labels_key
from veomni_lite.models.hf_attention import takes_boundaries
from veomni_lite.models.pretrained import PretrainedDirError, image_token, read_model_directory, text_config
from veomni_lite.models.registry import family_of
from veomni_lite.trainer.base import MODEL_CONFIG_DIR, BaseTrainer

logger = logging.getLogger(__name__)


# The defaults `trainers/train_sft.py` starts from, under the YAML and the command line (`load_config(..., defaults=)`),
# fit for fine-tuning a released model rather than training the tiny examples from scratch: transformers' Trainer
# defaults, which TRL's SFTTrainer and LLaMA-Factory inherit (3 epochs, no weight decay, AdamW betas (0.9, 0.999) and
# eps 1e-8, clipping at 1.0), with LLaMA-Factory's full fine-tuning recipe's lr 1e-5 and cosine decay (to 0, as
# transformers' cosine) and the Alpaca / Vicuna recipes' 3% warmup.
SFT_DEFAULTS: dict[str, dict[str, Any]] = {
    "train": {"epochs": 3, "max_steps": 0},
    "optim": {
        "lr": 1e-5,
        "schedule": "cosine",
        "min_lr_ratio": 0.0,
        "warmup_ratio": 0.03,
        "warmup_steps": 0,
        "weight_decay": 0.0,
    },
}


def _max_seq_len(data: Any) -> int:
    """`data.max_seq_len`, within `data.max_tokens_per_micro_batch` where a token budget is set (so a longer sample
    gets `data.overlength` like any other, the row named)."""
    budget = data.max_tokens_per_micro_batch
    return min(data.max_seq_len, budget) if budget and data.max_seq_len else budget or data.max_seq_len


def cache_dir(config: Any) -> Path:
    """`data.cache_dir`, by default `<train.output_dir>/data_cache` (a directory every rank already shares)."""
    return Path(config.data.cache_dir or Path(config.train.output_dir) / "data_cache")


def build_sft_data(config: Any, group: Any = None) -> tuple[Any, Any, Any, SFTDataset | None, Any]:
    """(model config, tokenizer, train dataset (a `WeightedMixture` with `data.sources`, a `SampleStream` with
    `data.streaming`), eval dataset or None, image processing or None) from the config, through the cache
    (`data.cache_dir`). Collective over `group` when several ranks call it: they share the preprocessing, and every
    error is raised on every rank."""
    problem: Exception | None = None
    try:
        model_config, tokenizer, images, encoder, splits = _read_sft_inputs(config)
    except (DataError, PretrainedDirError) as exc:
        problem = exc
    agree(problem, DataError, group, where="SFT data: ")
    data = config.data
    common = {"max_seq_len": _max_seq_len(data), "overlength": data.overlength, "images": images}
    cached = {"cache_dir": cache_dir(config), "group": group}
    stream = None
    if data.streaming:  # the training files read while training (veomni_lite.data.streaming); eval through the cache
        name, sources, options, _ = splits.pop(0)  # data.train_path (config validation refuses data.sources)
        window, seed = data.shuffle_window, config.train.seed
        stream = SampleStream(RowEncoder(sources, encoder, **options, **common), window, seed, what=name)
    built = {
        name: SFTDataset(RowEncoder(sources, encoder, **options, **common), **cached, what=name)
        for name, sources, options, _ in splits
    }
    evaluation = built.pop("data.eval_path", None)
    if stream is not None:
        train: Any = stream
    elif data.sources:
        weights = [weight for name, _, _, weight in splits if name in built]
        train = WeightedMixture(list(built.values()), weights, list(built))
    else:
        train = built["data.train_path"]
    return model_config, tokenizer, train, evaluation, images


def _read_sft_inputs(config: Any) -> tuple[Any, Any, Any, ChatEncoder, list[tuple[str, list[Any], dict, float]]]:
    """What every rank reads before the preprocessing (the model directory, the files of each split), where a
    rank's own problem shows."""
    model, data = config.model, config.data
    if not model.pretrained_dir:
        raise DataError("model.pretrained_dir: SFT needs a local transformers model directory")
    if not data.train_path and not data.sources:
        raise DataError("data.train_path: SFT needs the training data (a file, a list, a directory or a glob)")
    directory = read_model_directory(model.pretrained_dir, data.chat_template, data.train_on_prompt)
    plain = {"fmt": data.format, "columns": data.columns, "media_dir": data.media_dir}
    splits = []
    for index, entry in enumerate(data.sources):
        name = f"data.sources[{index}]"
        options = {
            "fmt": entry.get("format", data.format),
            "columns": entry.get("columns", data.columns),
            "media_dir": entry.get("media_dir", data.media_dir),
        }
        splits.append((name, read_sources(entry["path"], f"{name}.path"), options, float(entry.get("weight", 1.0))))
    if data.train_path:
        splits.append(("data.train_path", read_sources(data.train_path, "data.train_path"), plain, 1.0))
    if data.eval_path:
        splits.append(("data.eval_path", read_sources(data.eval_path, "data.eval_path"), plain, 1.0))
    return directory.config, directory.tokenizer, directory.images, directory.encoder, splits


class SFTTrainer(BaseTrainer):
    """The model, data and collate of a fine-tuning run (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        # The directory's tokenizer files byte for byte beside the model config, with a data.chat_template as
        # chat_template.jinja: what `python -m veomni_lite.export` writes out with the weights.
        if self.is_main:
            directory = self.config.model.pretrained_dir
            vision = self.images is not None
            placeholder = image_token(self.tokenizer, self.model_config, directory) if vision else ""
            template = override_template(self.config.data.chat_template, placeholder)
            copy_tokenizer_files(directory, self.output_dir / MODEL_CONFIG_DIR, template, prune=True)

    def build_datasets(self) -> tuple[Any, Any | None]:
        """The datasets (`build_sft_data`: an input error on one rank is a DataError on every rank; the checks here
        read only what every rank shares). Evaluation is on when `train.eval_interval` and `train.eval_batches` are
        both nonzero (the loop evaluates then and only then): the eval set is `data.eval_path`'s rows or, without
        it, `data.eval_fraction` of the training samples, held out. Off, no eval set is returned and every training
        sample trains."""
        data, train = self.config.data, self.config.train
        built = build_sft_data(self.config, self.control_group)
        self.model_config, self.tokenizer, dataset, evaluation, self.images = built
        evaluates = bool(train.eval_interval and train.eval_batches)
        stats, held_out = dataset.stats, 0
        if evaluates and evaluation is None and data.eval_fraction > 0:
            dataset, evaluation = hold_out(dataset, data.eval_fraction, train.seed)
            held_out = epoch_size(evaluation)
        if self.is_main:
            if not evaluates:
                why = "evaluation off: train.eval_interval or train.eval_batches is 0"
            else:
                why = "eval: data.eval_path" if data.eval_path else f"data.eval_fraction {data.eval_fraction}"
            trains = "streamed" if isinstance(dataset, SampleStream) else f"{epoch_size(dataset)} samples train"
            logger.info("SFT data: train %s; %s, %d held out (%s)", stats, trains, held_out, why)
            if data.eval_path and evaluation is not None:
                logger.info("SFT data: eval %s%s", evaluation.stats, "" if evaluates else " (unused: evaluation off)")
        held = epoch_size(evaluation) if evaluation is not None else 0
        if evaluates and evaluation is not None and held < train.global_batch_size:
            raise DataError(
                f"the eval set has {held} samples, fewer than one eval batch (train.global_batch_size = "
                f"{train.global_batch_size}); add eval data, raise data.eval_fraction or set train.eval_batches: 0"
            )
        streamed = isinstance(dataset, SampleStream)  # no length to check: a stream refuses a pass under one batch
        if not streamed and epoch_size(dataset) < train.global_batch_size:
            raise DataError(
                f"the training set has {epoch_size(dataset)} samples per epoch, fewer than train.global_batch_size "
                f"({train.global_batch_size})"
            )
        return dataset, evaluation if evaluates else None

    def _make_loader(
        self, dataset: Any, seed: int, prefetch_steps: int = 0, token_budget: bool = False
    ) -> MicroBatchLoader | StreamingLoader:
        """A `StreamingLoader` for the stream of `data.streaming` (its seed is `train.seed`), else the base loader."""
        if not isinstance(dataset, SampleStream):
            return super()._make_loader(dataset, seed, prefetch_steps, token_budget)
        train, data = self.config.train, self.config.data
        return StreamingLoader(
            dataset, self.collate, train.global_batch_size, train.micro_batch_size, self.parallel.dp_size,
            self.parallel.dp_rank, prefetch_steps, data.max_tokens_per_micro_batch if token_budget else 0, data.packing,
        )  # fmt: skip

    def build_model(self) -> Any:
        return self.pretrained_model(self.config.model.pretrained_dir)

    @property
    def vocab_size(self) -> int:
        return int(text_config(self.model_config).vocab_size)

    @property
    def pad_id(self) -> int:
        tokenizer = self.tokenizer
        return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0)

    def collate(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return self.collator()(samples)

    def collator(self) -> Callable[[Sequence[Mapping[str, torch.Tensor]]], dict[str, torch.Tensor]]:
        """The model's collate function with the run's settings (`collate`, or the VL family's), holding no trainer."""
        multiple, packing = self.config.data.pad_to_multiple_of, self.config.data.packing
        if self.images is None:
            varlen = takes_boundaries(self.config.model.attn_implementation)
            share = packing and self.config.data.shared_prefix and not varlen
            return functools.partial(
                collate, pad_to_multiple_of=multiple, pad_id=self.pad_id, packing=packing, share_prefixes=share
            )
        family, image_token_id = family_of(self.model_config), self.model_config.image_token_id
        return functools.partial(
            family.collate, image_token_id=image_token_id, images=self.images, pad_id=self.pad_id,
            pad_to_multiple_of=multiple, packing=packing,
        )  # fmt: skip

    @torch.no_grad()
    def extra_eval_metrics(self) -> dict[str, float]:
        """`answer_accuracy`: the share of eval samples (those of the eval losses) whose every trained token the model
        predicts greedily under teacher forcing. Under SP the shards of a sample add up their wrong tokens first."""
        if self.eval_dataset is None:
            return {}
        state = self.parallel
        loader = self._make_loader(self.eval_dataset, self.config.train.seed + 1)
        hits = torch.zeros(2, dtype=torch.long, device=self.device)
        try:
            for number in range(self.config.train.eval_batches):
                for micro_batch in self.eval_micro_batches(loader, number):
                    hits += self._answer_hits(micro_batch)
        finally:
            loader.close()
        correct, counted = all_reduce(hits.cpu().tolist(), op="sum", group=state.world_group)
        return {"answer_accuracy": correct / max(counted, 1)}

    def _answer_hits(self, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(samples right, samples counted) of one eval micro-batch on this rank (collective within the SP group)."""
        state = self.parallel
        inputs = {key: value for key, value in micro_batch.items() if not is_labels_key(key)}
        logits = self.model(**self.preforward(inputs))["logits"]
        labels = micro_batch["labels"].to(self.device)
        sample = micro_batch[SEQUENCE_IDS].to(self.device)  # rows, or a packed row's samples
        valid = (labels != IGNORE_INDEX) & (sample >= 0)
        wrong = (logits.argmax(-1) != labels) & valid
        at = sample.clamp(min=0).flatten()  # masked entries add 0: no boolean indexing, so no host sync
        per_sample = torch.zeros(2, self.config.train.micro_batch_size, dtype=torch.long, device=self.device)
        per_sample[0].index_add_(0, at, wrong.flatten().long())  # wrong, then trained, tokens per sample
        per_sample[1].index_add_(0, at, valid.flatten().long())
        if state.sp_size > 1:
            per_sample = all_reduce(per_sample, op="sum", group=state.sp_group)
        counted = per_sample[1] > 0
        if state.sp_rank != 0:  # the sp group's ranks hold the same samples: count them once
            return torch.zeros(2, dtype=torch.long, device=self.device)
        return torch.stack([(counted & (per_sample[0] == 0)).sum(), counted.sum()])
