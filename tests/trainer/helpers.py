"""Small trainer runs for tests: tiny configs, in-process (single rank) or on spawned gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from veomni_lite.config import Config, load_config, replace
from veomni_lite.examples.text_trainer import TextTrainer
from veomni_lite.examples.vlm_trainer import VLMTrainer

REPO = Path(__file__).resolve().parents[2]
TRAINERS = {
    "text": (TextTrainer, REPO / "configs" / "text_tiny.yaml"),
    "vlm": (VLMTrainer, REPO / "configs" / "vlm_tiny.yaml"),
}


def tiny_config(kind: str, output_dir: str | Path, **train: Any) -> Config:
    """The shipped config shrunk for tests; `train` overrides train.* fields."""
    _, path = TRAINERS[kind]
    config = load_config(path, world_size=1)
    settings = {
        "max_steps": 4,
        "log_interval": 1,
        "save_interval": 0,
        "eval_interval": 0,
        "micro_batch_size": 2,
        "global_batch_size": 8,
        "warmup_steps": 1,
        "progress_bar": False,
        "tensorboard": False,
        "plot": False,
        "output_dir": str(output_dir),
    }
    settings.update(train)
    return replace(
        config, model={"hidden_size": 32, "intermediate_size": 64}, data={"num_samples": 256}, train=settings
    )


def run_trainer(kind: str, config: Config, stop_after: int | None = None) -> list[dict[str, Any]]:
    """Train; return the JSONL events. `stop_after=k` requests a stop (as SIGTERM would) after step k."""
    trainer_cls, _ = TRAINERS[kind]
    trainer = trainer_cls(config)
    if stop_after is not None:
        original = trainer.train_step

        def train_step(micro_batches):
            original(micro_batches)
            if trainer.step == stop_after:
                trainer._stop_signal = 15

        trainer.train_step = train_step
    try:
        trainer.train()
    except SystemExit as exc:
        if stop_after is None:
            raise
        assert exc.code == 128 + 15
    finally:
        trainer.metrics.close()
    return read_events(config.train.output_dir)


def read_events(output_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses_by_step(events: list[dict[str, Any]], key: str = "train/loss") -> dict[int, float]:
    return {event["step"]: event[key] for event in events if key in event}


def ranked_run(rank: int, world_size: int, kind: str, config: Config) -> dict[int, float] | None:
    """Entry for `run_distributed`: every rank trains; rank 0 returns the per-step losses."""
    run_trainer(kind, config)
    return losses_by_step(read_events(config.train.output_dir)) if rank == 0 else None
