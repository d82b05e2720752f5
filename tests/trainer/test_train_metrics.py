"""MetricLogger keeps each micro-batch's values and records the step's sums: the same logged values as recording every
micro-batch, a zero-token shard's NaN mean dropped, nothing in the window before the step ends."""

from __future__ import annotations

import json
import math

import pytest
import torch

from veomni_lite.config import LoggingConfig
from veomni_lite.distributed.parallel_state import ParallelState
from veomni_lite.loss_keys import IGNORE_INDEX
from veomni_lite.metrics import MetricLogger
from veomni_lite.utils.loss_utils import LossModes, count_loss_token, mark_sequences

PAD = 0


def make_metrics(tmp_path, loss_modes: LossModes | None = None) -> MetricLogger:
    settings = LoggingConfig(log_interval=2, progress_bar=False, tensorboard=False, plot=False, async_step_end=False)
    return MetricLogger(
        settings,
        ParallelState(),
        loss_names=["foundation_loss", "aux_loss"],
        output_dir=tmp_path,
        max_steps=2,
        device=torch.device("cpu"),
        flops_per_token=lambda seq_len: 6.0 * seq_len,
        loss_modes=loss_modes,
        pad_id=PAD,
    )


def micro_batch(seq: int, seed: int, aux_targets: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, 9, (2, seq), generator=gen)
    input_ids[:, -1] = PAD
    labels = torch.randint(1, 9, (2, seq), generator=gen)
    labels[torch.rand(labels.shape, generator=gen) < 0.3] = IGNORE_INDEX
    aux = torch.randint(1, 9, (2, seq), generator=gen) if aux_targets else torch.full((2, seq), IGNORE_INDEX)
    return {"input_ids": input_ids, "labels": labels, "aux_labels": aux}


def test_a_step_is_recorded_once_with_the_sums_of_its_micro_batches(tmp_path):
    metrics = make_metrics(tmp_path)
    expected_totals = {"foundation_loss": [0.0, 0], "aux_loss": [0.0, 0]}
    tokens = samples = flops = 0.0
    for step in (1, 2):
        batches = [micro_batch(4 + i, seed=10 * step + i, aux_targets=i != 1) for i in range(3)]
        step_counts = count_loss_token(batches)
        assert set(step_counts) == {"foundation_tokens", "aux_tokens"}
        for index, batch in enumerate(batches):
            counts = count_loss_token(batch)
            means = {
                "foundation_loss": torch.tensor(1.0 + index + step, requires_grad=True) * 1.0,
                "aux_loss": torch.tensor(float("nan")) if index == 1 else torch.tensor(0.5 * index),
            }
            metrics.record_micro_batch(means, counts, batch)
            for key, name in (("foundation_loss", "foundation_tokens"), ("aux_loss", "aux_tokens")):
                n = int(counts[name])
                if n:
                    expected_totals[key][0] += float(means[key].detach()) * n
                    expected_totals[key][1] += n
            seen = int((batch["input_ids"] != PAD).sum())
            tokens, samples, flops = tokens + seen, samples + 2, flops + seen * 6.0 * batch["input_ids"].shape[1]
        if step == 1:
            assert metrics.train.is_empty, "nothing reaches the window before the step ends"
        metrics.record_step(torch.tensor(1.0), lr=1e-3, skipped=False, step_time=0.1, bookkeeping_wait=0.0)
        metrics.end_step(step, epoch=0)
    metrics.finish(2, 0)
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["step"] == 2
    for key, (total, count) in expected_totals.items():
        assert row[f"train/{key}"] == pytest.approx(total / count, rel=1e-12)
    assert math.isfinite(row["train/aux_loss"])
    assert row["train/tokens"] == tokens and row["train/samples"] == samples
    assert row["train/flops"] == pytest.approx(flops, rel=1e-12)


def test_a_step_that_fails_after_its_micro_batches_is_logged_by_finish(tmp_path):
    metrics = make_metrics(tmp_path)
    batch = micro_batch(5, seed=1, aux_targets=True)
    count_loss_token([batch])
    counts = count_loss_token(batch)
    metrics.record_micro_batch(
        {"foundation_loss": torch.tensor(float("nan")), "aux_loss": torch.tensor(2.0)}, counts, batch
    )
    metrics.finish(1, 0)  # a non-finite verdict raised before record_step
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["step"] == 1 and row["train/aux_loss"] == 2.0
    assert row["train/foundation_loss"] is None or math.isnan(row["train/foundation_loss"])


def test_a_window_weights_each_step_by_its_modes_denominator(tmp_path):
    """seq-mean-token-sum: the window is the steps' numerators over their sequence counts; token-sum: the mean of the
    steps' sums. At log_interval 1 each would be its step's normalized value."""
    modes = LossModes("seq-mean-token-sum", {"aux": "token-sum"})
    metrics = make_metrics(tmp_path, modes)
    numerators, sequences, sums = 0.0, 0, 0.0
    for step in (1, 2):
        batches = [mark_sequences(micro_batch(4 + i, seed=10 * step + i, aux_targets=True), modes) for i in range(2)]
        for index, batch in enumerate(batches):
            counts = count_loss_token(batch)
            means = {"foundation_loss": torch.tensor(1.0 + index + 3 * step), "aux_loss": torch.tensor(0.5 + step)}
            metrics.record_micro_batch(means, counts, batch)
            numerators += float(means["foundation_loss"]) * int(counts["foundation_tokens"])
            sequences += int(counts["foundation_sequences"])
            sums += float(means["aux_loss"]) * int(counts["aux_tokens"])
        metrics.record_step(torch.tensor(1.0), lr=1e-3, skipped=False, step_time=0.1, bookkeeping_wait=0.0)
        metrics.end_step(step, epoch=0)
    metrics.finish(2, 0)
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert sequences == 8, "two rows with targets per micro-batch"
    assert row["train/foundation_loss"] == pytest.approx(numerators / sequences, rel=1e-12)
    assert row["train/aux_loss"] == pytest.approx(sums / 2, rel=1e-12)
