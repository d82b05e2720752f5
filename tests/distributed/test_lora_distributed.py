"""LoRA under FSDP2 on real gloo processes.

The split-invariance harness with adapters on (B drawn at random, so A has gradients): float64 Qwen2 in every loss
mode and Qwen2-VL with its image head in the two-head plans, at GA, DP=2, SP=2 and packed layouts (token budgets
included), against the one-process, one-micro-batch step. The trainer on the help job from its directory: DP=2,
HSDP, SP=2 packed with a token budget, activation checkpointing in another loss mode, and the base held in bf16,
each against one process; base weights frozen in their shards and equal to the directory's, the optimizer holding
the adapters only; the checkpoint of a 2-rank run resumed on 1 process continues with the uninterrupted losses.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_helpers import run_distributed
from tests.distributed import packing_fixtures as fx
from tests.distributed.modes_fixtures import MODE_PLANS, SCALE_FACTOR
from tests.models import lora_fixtures as lx
from tests.trainer.helpers import losses_by_step, read_events
from veomni_lite.split_invariance import Layout, check_split_invariance
from veomni_lite.trainer.sft import SFTTrainer
from veomni_lite.utils.loss_utils import LOSS_MODES, LossModes

TEXT_MODES = [LossModes(mode, scale_factor=SCALE_FACTOR) for mode in LOSS_MODES]
VL_MODES = [LossModes(default, {"image_decoder": image}, SCALE_FACTOR) for default, image in MODE_PLANS]
TEXT_LAYOUTS = [
    Layout(1, 1, 1),  # GA 8
    Layout(2, 1, 2),
    Layout(1, 2, 4),
    Layout(1, 2, 4, packed=True),
    Layout(2, 1, 2, packed=True, max_tokens=24),
]
VL_LAYOUTS = [Layout(2, 1, 2), Layout(1, 2, 4), Layout(1, 2, 4, packed=True)]
HARNESS = {
    "text": (lx.build_text_lora, fx.text_samples, fx.collate_text, fx.pack_text, TEXT_MODES, TEXT_LAYOUTS),
    "vl": (lx.build_vl_lora, fx.vl_samples, fx.collate_vl, fx.pack_vl, VL_MODES, VL_LAYOUTS),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["text", "vl"])
def test_lora_gradients_are_split_invariant_at_every_layout_and_mode(kind):
    build, samples, collate, pack, modes, layouts = HARNESS[kind]
    start = time.monotonic()
    report = check_split_invariance(build, samples(), collate, modes, layouts, packed_collate=pack)
    print(f"\n{kind} with LoRA, against one process:\n{report}\n({time.monotonic() - start:.0f} s)")
    trains = [param.requires_grad for param in build().parameters()]
    assert 0 < sum(trains) < len(trains)
    for (layout, mode), grads in report.grads.items():
        assert all(not g.any() for g, t in zip(grads, trains) if not t), (layout, mode)  # frozen: no gradient
        if layout == "reference":  # not vacuous: every adapter, A included, has a gradient
            assert all(g.abs().max() > 1e-6 for g, t in zip(grads, trains) if t), mode
    for key, diff in report.grad_diff.items():
        assert diff < 1e-10 and report.loss_diff[key] < 1e-10, (key, diff)
    for layout in layouts:
        assert report.collectives_per_step[str(layout)] == (1 if layout.dp * layout.sp > 1 else 0)


# ---------------------------------------------------------------- the trainer


VARIANTS: dict[str, list[str]] = {
    "dp2": ["--train.max_steps", "4", "--checkpoint.save_interval", "2"],
    "hsdp": ["--parallel.dp_replicate", "2"],
    "sp2_packed_budget": ["--parallel.sp_size", "2", "--data.packing", "true"]
    + ["--data.max_tokens_per_micro_batch", "96"],
    "ac_seq_mean": ["--parallel.activation_checkpointing", "true", "--loss.mode", "seq-mean-token-mean"],
    "bf16_base": ["--parallel.master_dtype", "bf16", "--train.max_steps", "2"],
}


def _train(demo: Path, out: Path, world_size: int, *extra: str) -> SFTTrainer:
    """A LoRA run of the help job; a constant learning rate, so runs of different lengths share their steps."""
    return lx.train("sft_help.yaml", lx.help_args(demo, out, "--optim.schedule", "constant", *extra), world_size)


def _facts(trainer: SFTTrainer, demo: Path) -> dict[str, Any]:
    """What this rank holds: dtypes, gradients and optimizer state by kind, and whether the base equals the files."""
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor

    files = load_file(str(demo / "models/qwen2_help/model.safetensors"))
    base_equal, dtypes = True, {}
    for name, param in trainer.model.named_parameters():
        kind = "adapter" if param.requires_grad else "base"
        dtypes.setdefault(kind, set()).add(str(param.dtype))
        assert isinstance(param, DTensor), name
        if kind == "base":
            assert param.grad is None, name
            full = param.full_tensor()
            base_equal &= torch.equal(full, files[name.removeprefix("hf_model.")].to(full.dtype))
    state = trainer.optimizer.state
    return {
        "dtypes": {kind: sorted(values) for kind, values in dtypes.items()},
        "base_equal": bool(base_equal),
        "optimizer_params": len(state),
        "optimizer_only_adapters": all(p.requires_grad for p in state),
        "optimizer_dtypes": sorted({str(v.dtype) for s in state.values() for k, v in s.items() if k != "step"}),
        "adapters": len(trainer.trainable),
    }


def _runs(rank: int, world_size: int, demo: Path, out: Path) -> dict[str, Any]:
    results = {}
    for name, extra in VARIANTS.items():
        trainer = _train(demo, out / name, world_size, *extra)
        events = read_events(out / name) if rank == 0 else []
        results[name] = {
            "loss": losses_by_step(events),
            "grad_norm": losses_by_step(events, "train/grad_norm"),
            "facts": _facts(trainer, demo),
        }
    return results


@pytest.mark.slow
def test_the_trainer_with_lora_on_two_ranks_trains_the_one_process_steps_and_resumes_on_one(demo, tmp_path):
    start = time.monotonic()
    ranks = run_distributed(_runs, 2, demo, tmp_path / "two", timeout_s=1200)
    two = ranks[0]
    one = {
        "token-mean": _train(demo, tmp_path / "one", 1, "--train.max_steps", "4"),
        "seq-mean": _train(demo, tmp_path / "one_seq", 1, "--loss.mode", "seq-mean-token-mean"),
    }
    ones = {key: losses_by_step(read_events(t.output_dir)) for key, t in one.items()}
    norms = {key: losses_by_step(read_events(t.output_dir), "train/grad_norm") for key, t in one.items()}
    print(f"\none process: {ones}\ntwo ranks: { {k: v['loss'] for k, v in two.items()} } "
          f"({time.monotonic() - start:.0f} s)")  # fmt: skip
    for name, result in two.items():
        reference = "seq-mean" if name == "ac_seq_mean" else "token-mean"
        tolerance = 2e-2 if name == "bf16_base" else 1e-5  # bf16: the base's rounding in every matmul
        for step, loss in result["loss"].items():
            assert loss == pytest.approx(ones[reference][step], rel=tolerance), (name, step)
            assert result["grad_norm"][step] == pytest.approx(norms[reference][step], rel=20 * tolerance), name
    for rank, results in enumerate(ranks):
        for name, result in results.items():
            facts = result["facts"]
            assert facts["base_equal"] and facts["optimizer_only_adapters"], (rank, name, facts)
            assert facts["optimizer_params"] == facts["adapters"] == 16, (rank, name, facts)
            assert facts["optimizer_dtypes"] == ["torch.float32"], (rank, name, facts)
            base = "torch.bfloat16" if name == "bf16_base" else "torch.float32"
            assert facts["dtypes"] == {"adapter": ["torch.float32"], "base": [base]}, (rank, name, facts)

    # 2 -> 1: the dp2 run's step-2 checkpoint resumed in one process
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "two/dp2/checkpoints/step_00000002", resumed / "checkpoints/step_00000002")
    _train(demo, resumed, 1, "--train.max_steps", "4", "--checkpoint.resume", "true")
    again = losses_by_step(read_events(resumed))
    print(f"resumed on 1 process from step 2: {again}")
    assert set(again) == {3, 4}
    assert all(again[step] == pytest.approx(two["dp2"]["loss"][step], rel=1e-5) for step in again)
