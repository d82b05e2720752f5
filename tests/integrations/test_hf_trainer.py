"""`veomni_lite.integrations.hf`: the Hugging Face Trainer (and TRL's SFTTrainer) trains on the step's exact loss.

The slow test runs a real `transformers.Trainer` under torchrun (2 gloo processes, GA 2, variable-length
micro-batches) and compares each step's gradient with a one-process, hand-written reference on the whole global
batch, for the exact Trainer and for the stock one (both differences printed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integrations.hf_cases import build, collate, reference_loss, samples
from tests.integrations.hf_worker import GA, STEPS, Record
from veomni_lite.integrations.hf import ExactLossTrainer, prepare_micro_batch
from veomni_lite.loss_keys import IGNORE_INDEX
from veomni_lite.utils.loss_utils import LossModes

REPO = Path(__file__).resolve().parents[2]


def step_batches(runs: list[dict], step: int) -> list[dict]:
    """The micro-batches every rank trained on in optimizer step `step`."""
    return [batch for run in runs for batch in run["batches"][step * GA : (step + 1) * GA]]


def step_gradient_differences(runs: list[dict]) -> list[float]:
    """Per step: max |gradient - reference| / max |reference| over the parameters, the reference from the rank-0
    parameters at the step's start on the micro-batches every rank trained on in that step."""
    model = build(runs[0]["kind"])
    out = []
    for step in range(STEPS):
        model.load_state_dict(runs[0]["params"][step])
        model.zero_grad()
        reference_loss(model, step_batches(runs, step)).backward()
        expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        scale = max(float(g.abs().max()) for g in expected.values())
        out.append(max(float((runs[0]["grads"][step][n] - g).abs().max()) for n, g in expected.items()) / scale)
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[tuple[str, str], list[dict]]:
    out = tmp_path_factory.mktemp("hf")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run(
        [*command, "-m", "tests.integrations.hf_worker", str(out), "vl", "vl25", "text", "--trl"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    runs = {}
    for path in sorted(out.glob("*-0.pt")):
        kind, trainer = path.stem.split("-")[:2]
        runs[kind, trainer] = [torch.load(out / f"{kind}-{trainer}-{r}.pt", weights_only=False) for r in range(2)]
        for run in runs[kind, trainer]:
            run["kind"] = kind
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["vl", "vl25", "text"])
def test_under_torchrun_each_steps_gradient_is_the_one_process_references_where_the_stock_trainers_is_not(
    trained, kind
):
    exact, stock = step_gradient_differences(trained[kind, "exact"]), step_gradient_differences(trained[kind, "stock"])
    print(f"\n{kind}: relative gradient difference per step, exact {exact}, stock Trainer {stock}")
    assert max(exact) < 1e-10
    if kind != "vl":  # Qwen2-VL accepts loss kwargs in transformers 5.24, so the stock Trainer is exact up to float32
        assert min(stock) > 1e-2, "the stock Trainer averages micro-batch means (or drops the second head's count)"
    for run in trained[kind, "exact"]:
        assert run["loss_all_reduces"] == STEPS, "one loss all-reduce per optimizer step"
    print(f"  Python-level collectives: exact {trained[kind, 'exact'][0]['collectives']}, "
          f"stock {trained[kind, 'stock'][0]['collectives']} over {STEPS} steps")  # fmt: skip


@pytest.mark.slow
def test_trls_sft_trainer_made_exact_trains_on_the_references_gradient(trained):
    differences = step_gradient_differences(trained["vl25", "trl"])
    print(f"\nTRL SFTTrainer (exact_loss), Qwen2.5-VL: relative gradient difference per step {differences}")
    assert max(differences) < 1e-10


@pytest.mark.slow
def test_the_logged_loss_is_the_steps_exact_value(trained):
    for kind in ("vl25", "text"):
        runs = trained[kind, "exact"]
        model = build(kind)
        for step, logged in enumerate(runs[0]["losses"]):
            model.load_state_dict(runs[0]["params"][step])
            with torch.no_grad():
                expected = reference_loss(model, step_batches(runs, step))
            assert logged == pytest.approx(float(expected), rel=1e-6)  # the Trainer logs float32


def test_prepare_micro_batch_shifts_once_and_masks_targets_across_packed_sequences():
    labels = torch.tensor([[5, 6, 7, 8, 9, 10]])
    batch = prepare_micro_batch({"labels": labels}, LossModes())
    assert batch["labels"].tolist() == [[6, 7, 8, 9, 10, IGNORE_INDEX]]
    given = prepare_micro_batch({"labels": labels, "shift_labels": labels + 1}, LossModes())
    assert given["labels"].tolist() == (labels + 1).tolist() and "shift_labels" not in given
    packed = {"labels": labels, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]])}  # two padding-free samples
    batch = prepare_micro_batch(packed, LossModes("seq-mean-token-mean"))
    assert batch["labels"].tolist() == [[6, 7, IGNORE_INDEX, 9, 10, IGNORE_INDEX]]
    assert batch["foundation_seq_starts"].sum() == 2, "each packed sample is its own sequence"
    assert batch["foundation_loss_weights"][0].tolist() == [0.5, 0.5, 0, 0.5, 0.5, 0]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_one_process_with_accumulation_equals_the_reference(tmp_path, mode):
    """The same contract without a process group: GA 2 over micro-batches of different lengths, in two modes."""
    from transformers import TrainingArguments

    data = samples("vl25", 4)
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1,
        learning_rate=0.0, optim="sgd", max_grad_norm=0.0, report_to=[], use_cpu=True, save_strategy="no",
        disable_tqdm=True, remove_unused_columns=False, dataloader_drop_last=True,
    )  # fmt: skip
    model, seen, record = build("vl25"), [], Record()

    def recording_collate(rows: list[dict]) -> dict:
        seen.append(collate(rows))
        return seen[-1]

    record.trainer = ExactLossTrainer(
        model=model, args=args, train_dataset=data, data_collator=recording_collate, callbacks=[record], loss_modes=mode
    )
    record.trainer.train()
    (got,) = record.grads
    reference_loss(model, seen[:2], mode).backward()
    worst = max(float((got[n] - p.grad).abs().max()) for n, p in model.named_parameters() if p.grad is not None)
    assert worst < 1e-12


class LogitsOnly(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 64)

    def forward(self, input_ids: torch.Tensor, extra_labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return {"logits": self.embed(input_ids)}


def test_a_head_the_model_does_not_return_and_label_smoothing_are_clear_errors(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], label_smoothing_factor=0.1)
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        ExactLossTrainer(model=build("vl"), args=args)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = ExactLossTrainer(model=LogitsOnly(), args=args)
    ids = torch.tensor([[1, 2, 3]])
    batches, step = trainer.get_batch_samples(iter([{"input_ids": ids, "labels": ids, "extra_labels": ids}]), 1, "cpu")
    with pytest.raises(KeyError, match="'extra_labels' but the model returned no 'extra_loss'"):
        trainer.compute_loss(trainer.model, batches[0], num_items_in_batch=step)
