"""torchrun worker: the Hugging Face Trainer (or TRL's SFTTrainer), exact and stock, on each case of `hf_cases`
(GA 2, variable-length micro-batches); writes per rank the raw micro-batches it trained on, the logged entries and,
on rank 0, the parameters at each step's start and the gradients before each optimizer step, to
`<out>/<kind>-<trainer>-<rank>.pt`.

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.integrations.hf_worker OUT [KINDS...]
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainingArguments

from tests.dist_helpers import counting_calls
from tests.integrations.hf_cases import build, collate, samples, tokenizer, z_loss_func
from veomni_lite.distributed.collectives import destroy_process_groups
from veomni_lite.integrations.hf import ExactLossTrainer, exact_loss
from veomni_lite.utils import loss_utils

STEPS, GA, MICRO = 2, 2, 2
TRL_CASES = {"dft": {"loss_type": "dft"}, "pf": {"padding_free": True, "max_length": None}}  # SFTConfig
COLLECTIVES = ["all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "barrier"]


class Record(TrainerCallback):
    def __init__(self) -> None:
        self.params: list[dict[str, torch.Tensor]] = []
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.params.append({k: v.detach().clone() for k, v in model.state_dict().items()})

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = self.trainer.model
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def is_trl(trainer_class: type[Trainer]) -> bool:
    return any(c.__name__ == "SFTTrainer" for c in trainer_class.__mro__)


def train(kind: str, trainer_class: type[Trainer], out: Path, rank: int) -> dict[str, Any]:
    seen: list[dict[str, Any]] = []

    def recording(collator: Any) -> Any:
        def recording_collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
            batch = collator(rows)
            seen.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
            return batch

        return recording_collate

    data: Any = samples(kind, STEPS * GA * MICRO * int(os.environ["WORLD_SIZE"]))
    arguments_class, extra, trl = TrainingArguments, {}, {}
    if is_trl(trainer_class):  # TRL: its config and a `datasets` set; our collator, or TRL's padding-free one
        from datasets import Dataset
        from trl import SFTConfig

        arguments_class = SFTConfig
        # float64 throughout: TRL defaults to bf16 autocast, under which its fused head runs bf16 tiles
        extra = {"dataset_kwargs": {"skip_prepare_dataset": True}, "bf16": False, **TRL_CASES.get(kind, {})}
        data, trl = (
            Dataset.from_list([{k: v.tolist() for k, v in s.items()} for s in data]),
            {"processing_class": tokenizer()},
        )
    if kind == "func":
        trl["compute_loss_func"] = z_loss_func
    args = arguments_class(
        output_dir=str(out / f"run-{kind}"), per_device_train_batch_size=MICRO, gradient_accumulation_steps=GA,
        max_steps=STEPS, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0,
        weight_decay=0.0, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, ddp_backend="gloo",
        disable_tqdm=True, remove_unused_columns=False, seed=0, dataloader_drop_last=True, **extra,
    )  # fmt: skip
    record = Record()
    trainer = trainer_class(
        model=build(kind),
        args=args,
        train_dataset=data,
        data_collator=None if kind == "pf" else recording(collate),
        callbacks=[record],
        **trl,
    )
    if kind == "pf":
        trainer.data_collator = recording(trainer.data_collator)
    record.trainer = trainer
    with counting_calls(loss_utils, "all_reduce") as loss_reduces, counting_collectives() as collectives:
        trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return {
        "batches": seen, "params": record.params, "grads": record.grads, "losses": [e["loss"] for e in logs],
        "logs": logs, "loss_all_reduces": len(loss_reduces), "collectives": sum(map(len, collectives)),
    }  # fmt: skip


@contextlib.contextmanager
def counting_collectives() -> Iterator[list[list[int]]]:
    """Every torch.distributed collective called from Python (DDP's gradient buckets run in C++ and are not)."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(counting_calls(dist, name)) for name in COLLECTIVES]


def trainers(kind: str, with_trl: bool) -> dict[str, type[Trainer]]:
    """`exact` and `stock` for the case (TRL's SFTTrainer for the TRL cases); `trl`: also TRL's made exact."""
    if kind in TRL_CASES or with_trl:
        from trl import SFTTrainer
    if kind in TRL_CASES:
        return {"exact": exact_loss(SFTTrainer), "stock": SFTTrainer}
    out: dict[str, type[Trainer]] = {"exact": ExactLossTrainer, "stock": Trainer}
    if kind == "vl25" and with_trl:
        out["trl"] = exact_loss(SFTTrainer)
    return out


def main() -> None:
    """`--trl`: also TRL's SFTTrainer made exact, on Qwen2.5-VL."""
    out, kinds = Path(sys.argv[1]), [k for k in sys.argv[2:] if k != "--trl"] or ["vl", "vl25", "text"]
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    for kind in kinds:
        for name, trainer_class in trainers(kind, "--trl" in sys.argv).items():
            torch.save(train(kind, trainer_class, out, rank), out / f"{kind}-{name}-{rank}.pt")
    destroy_process_groups()


if __name__ == "__main__":
    main()
