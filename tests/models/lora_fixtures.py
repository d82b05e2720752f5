"""Fixtures of the LoRA tests, importable by spawned processes: float64 Qwen2 and Qwen2-VL with adapters for the
split-invariance harness (B drawn at random, so that A has gradients too: a fresh B is zero), and the on-disk SFT
demo (help pages + a tiny Qwen2 directory; the digits + a tiny directory of a VL family) with short runs' arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.distributed import packing_fixtures as fx
from veomni_lite.models.lora import LoraSettings, apply_lora, lora_modules

REPO = Path(__file__).resolve().parents[2]
# attention + MLP projections (the vision tower left out), the LoRA paper's alpha = 2 x rank
TEXT_LORA = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "k_proj", "v_proj", "down_proj"))
LORA_YAML = "{rank: 4, alpha: 8, target_modules: [q_proj, k_proj, v_proj, down_proj]}"


def random_b(model: torch.nn.Module, seed: int = 7, scale: float = 0.1) -> None:
    """Every adapter's B drawn from N(0, scale^2) (seeded, in module order), as after some training."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, module in lora_modules(model):
            b = module.lora_B.weight
            b.copy_(torch.randn(b.shape, generator=generator, dtype=torch.float64).to(b.dtype) * scale)


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    apply_lora(model, TEXT_LORA, seed=11)
    random_b(model)
    return model


def build_text_lora() -> torch.nn.Module:
    return with_lora(fx.build_text())


def build_vl_lora() -> torch.nn.Module:
    return with_lora(fx.build_vl())


def common_args(out: Path, *extra: str) -> list[str]:
    return [
        "--train.output_dir", str(out),
        "--train.eval_interval", "0",
        "--optim.warmup_steps", "0",
        "--checkpoint.save_interval", "0",
        "--logging.log_interval", "1",
        "--logging.progress_bar", "false",
        "--logging.tensorboard", "false",
        "--logging.plot", "false",
        *extra,
    ]  # fmt: skip


def help_args(demo: Path, out: Path, *extra: str) -> list[str]:
    """A short LoRA run of the help job: 3 steps of 8 samples of at most 64 tokens."""
    return [
        "--model.pretrained_dir", str(demo / "models" / "qwen2_help"),
        "--data.train_path", str(demo / "help" / "train.jsonl"),
        "--data.max_seq_len", "64",
        "--train.max_steps", "3",
        "--train.micro_batch_size", "2",
        "--train.global_batch_size", "8",
        "--model.lora", LORA_YAML,
        *common_args(out, *extra),
    ]  # fmt: skip


def digits_args(demo: Path, out: Path, family: str, *extra: str) -> list[str]:
    """A short LoRA run of the digits job on `demo/models/<family>`."""
    return [
        "--model.pretrained_dir", str(demo / "models" / family),
        "--data.train_path", str(demo / "digits" / "train.jsonl"),
        "--data.eval_path", str(demo / "digits" / "eval.jsonl"),
        "--train.max_steps", "2",
        "--train.micro_batch_size", "4",
        "--train.global_batch_size", "8",
        "--model.lora", LORA_YAML,
        *common_args(out, *extra),
    ]  # fmt: skip


def train(config: str, args: list[str], world_size: int) -> Any:
    """An SFT run of `configs/<config>` with `args`, its logger and loader closed after; the trainer, to inspect."""
    from veomni_lite.config import load_config
    from veomni_lite.trainer.sft import SFTTrainer

    trainer = SFTTrainer(load_config(REPO / "configs" / config, args, world_size=world_size))
    try:
        trainer.train()
    finally:
        trainer.metrics.close()
        trainer.loader.close()
    return trainer
