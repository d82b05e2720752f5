"""The trainer's own cost: the real `BaseTrainer` step against a bare FSDP2 loop, interleaved, the same processes.

- trainer step: what `BaseTrainer.train()` runs per step once the micro-batches are sharded (`_agree`, `train_step`,
  `metrics.end_step`) of a `VLMTrainer` from configs/vlm_tiny.yaml (no eval, checkpoint, TensorBoard, plot).
- bare step: the same model (the trainer's weights copied), `fully_shard` over the same mesh with the same gradient
  sync pattern, the same micro-batches and AdamW, the oracle's loss normalization; no checks, clipping, LR schedule
  or metrics. A check step from equal weights compares the two gradient norms (AssertionError beyond 1e-4).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from baselines import Oracle
from harness import MicroBatch, OpCounter, timed_reps

import veomni_lite.trainer.base as base
from examples.vlm_trainer import VLMTrainer
from veomni_lite.config import load_config, replace
from veomni_lite.distributed.fsdp import apply_fsdp, set_gradient_sync
from veomni_lite.distributed.grad_norm import clip_global_grad_norm
from veomni_lite.distributed.parallel_state import destroy_parallel_state, get_parallel_state
from veomni_lite.utils.loss_utils import count_loss_token, reset_loss_memo

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "vlm_tiny.yaml"


def build_trainer(world: int, micro_batch_size: int, log_interval: int, output_dir: str) -> VLMTrainer:
    """configs/vlm_tiny.yaml with the benchmark's micro-batch size (SP 1: dp = world) and no side outputs."""
    config = load_config(CONFIG, world_size=world)
    config = replace(
        config,
        train={
            "micro_batch_size": micro_batch_size,
            "global_batch_size": micro_batch_size * world,
            "max_steps": 10**6,
            "eval_interval": 0,
            "output_dir": output_dir,
        },
        data={"num_samples": 256, "eval_samples": 0},
        checkpoint={"save_interval": 0},
        logging={"log_interval": log_interval, "progress_bar": False, "tensorboard": False, "plot": False},
    )
    return VLMTrainer(config)


def build_bare(trainer: VLMTrainer) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A second copy of the trainer's model (its current weights), sharded the same way, with its own AdamW over the
    same parameter groups."""
    torch.manual_seed(0)
    model = trainer.build_model().to(trainer.device)
    model = apply_fsdp(model, get_parallel_state(), list(model.layers))
    with torch.no_grad():
        for bare, trained in zip(model.parameters(), trainer.model.parameters()):
            bare.copy_(trained)
    # the trainer's own parameter groups and AdamW settings: the same optimizer work in both loops
    return model, base.build_optimizer(model, trainer.config.optim)


def bare_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_keys: tuple[str, ...],
    micro_batches: list[MicroBatch],
    grad_norm: bool = False,
) -> torch.Tensor | None:
    """Forward, backward (FSDP2, gradient sync on the last micro-batch only), AdamW; the oracle's normalization.

    `grad_norm=True` (the check step) returns the global gradient norm before the update.
    """
    oracle = Oracle()
    step_tokens = count_loss_token(micro_batches)
    oracle.start_step(step_tokens, len(micro_batches))
    last = len(micro_batches) - 1
    for index, micro_batch in enumerate(micro_batches):
        set_gradient_sync(model, index == last)
        outputs = model(**micro_batch)
        scaled = oracle.scale({key: outputs[key] for key in loss_keys}, count_loss_token(micro_batch), step_tokens)
        loss = sum(scaled.values())
        loss.backward()
    norm = None
    if grad_norm:
        group = get_parallel_state().world_group
        norm, _ = clip_global_grad_norm(list(model.parameters()), 0.0, torch.zeros(()), group)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def trainer_step(trainer: VLMTrainer, micro_batches: list[MicroBatch]) -> None:
    """One step as `BaseTrainer.train()` runs it once the micro-batches are sharded."""
    trainer._agree(micro_batches)
    trainer.train_step(micro_batches)
    trainer.metrics.end_step(trainer.step, trainer.epoch, release=micro_batches)


def check_equal_work(
    trainer: VLMTrainer, model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[MicroBatch]
) -> dict[str, float]:
    """One step of each from equal weights and data: the trainer's gradient norm (its clip's input) must equal the
    bare step's (AssertionError otherwise)."""
    norms: list[torch.Tensor] = []
    clip = base.clip_global_grad_norm

    def keep_norm(*args: Any, **kwargs: Any) -> Any:
        out = clip(*args, **kwargs)
        norms.append(out[0].detach().clone())
        return out

    base.clip_global_grad_norm = keep_norm
    try:
        trainer_step(trainer, micro_batches)
    finally:
        base.clip_global_grad_norm = clip
    bare_norm = bare_step(model, optimizer, trainer.loss_keys, micro_batches, grad_norm=True)
    assert bare_norm is not None
    diff = float((norms[0] - bare_norm).abs() / bare_norm.abs().clamp(min=1e-30))
    if diff > 1e-4:
        raise AssertionError(f"trainer and bare step differ: grad norms {float(norms[0])} vs {float(bare_norm)}")
    return {"grad_norm_rel_diff": diff}


def bench_trainer(world: int, data_by_ga: dict[int, list[list[MicroBatch]]], micro_batch_size: int, args: Any) -> list:
    """Trainer step against bare step at every GA of `data_by_ga` (SP 1): records of bench "trainer"."""
    records: list[dict[str, Any]] = []
    # one output directory every rank shares (the trainer refuses one that some rank cannot see)
    output_dir = Path(tempfile.gettempdir()) / f"bench_trainer_{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}"
    with contextlib.ExitStack() as cleanup:
        if os.environ.get("RANK", "0") == "0":  # the rank that writes its files: another's removal could come first
            cleanup.callback(shutil.rmtree, output_dir, ignore_errors=True)
        trainer = build_trainer(world, micro_batch_size, 10, str(output_dir))
        cleanup.callback(destroy_parallel_state)
        cleanup.callback(reset_loss_memo)
        cleanup.callback(trainer.metrics.close)
        model, optimizer = build_bare(trainer)
        checked = check_equal_work(trainer, model, optimizer, next(iter(data_by_ga.values()))[0])
        for ga, data in data_by_ga.items():
            steps = {
                "trainer": lambda rep, d=data: trainer_step(trainer, d[rep % len(d)]),
                "bare": lambda rep, d=data: bare_step(model, optimizer, trainer.loss_keys, d[rep % len(d)]),
            }
            counts = {name: OpCounter().count(lambda run=run: run(0)) for name, run in steps.items()}
            times = timed_reps(steps, args.budget_s, args.min_reps, args.max_reps)
            for name in steps:
                record = {"bench": "trainer", "world": world, "sp": 1, "ga": ga, "strategy": name, "check": checked}
                records.append(record | {"counts": counts[name], "times_s": times[name]})
        trainer.metrics.finish(trainer.step, trainer.epoch)
    return records
