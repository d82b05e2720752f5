"""Small trainer runs for tests: tiny configs, in-process (single rank) or on spawned gloo ranks.

Kinds: "text" and "vlm" (the tiny example models), "qwen2_text" (PydocLMTrainer, a transformers Qwen2 causal LM)
and "qwen2_vl" (DigitsVLTrainer, Qwen2-VL with the image head). transformers is imported when a qwen2 model is built.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from examples.qwen2_pydoc_text import TOKENIZER_FILE, PydocLMTrainer
from examples.qwen2_vl_digits import DigitsVLTrainer
from examples.text_trainer import TextTrainer
from examples.vlm_trainer import VLMTrainer
from veomni_lite.config import Config, load_config, replace
from veomni_lite.trainer.base import BaseTrainer

REPO = Path(__file__).resolve().parents[2]
TRAINERS = {
    "text": (TextTrainer, REPO / "configs" / "text_tiny.yaml"),
    "vlm": (VLMTrainer, REPO / "configs" / "vlm_tiny.yaml"),
    "qwen2_text": (PydocLMTrainer, REPO / "configs" / "qwen2_text.yaml"),
    "qwen2_vl": (DigitsVLTrainer, REPO / "configs" / "qwen2_vl_digits.yaml"),
}
_TINY_MODEL = {"model": {"hidden_size": 32, "intermediate_size": 64}, "data": {"num_samples": 256}}
# The shipped transformers configs are already small; the text samples are shortened, and the digits' held-out
# split is cut to 17 images (eval/caption_accuracy runs a forward pass per 2 held-out images).
SHRINK: dict[str, dict[str, dict[str, Any]]] = {
    "text": _TINY_MODEL,
    "vlm": _TINY_MODEL,
    "qwen2_text": {"data": {"seq_len": 32}},
    "qwen2_vl": {"data": {"eval_fraction": 0.01}},
}


@functools.cache
def _pydoc_tokenizer_json(vocab_size: int) -> str:
    from examples.pydoc_text import train_tokenizer

    return train_tokenizer(vocab_size).to_str()


def tiny_config(kind: str, output_dir: str | Path, data: dict[str, Any] | None = None, **train: Any) -> Config:
    """The shipped config shrunk for tests; `data` overrides data.* fields, `train` overrides train.* fields.

    For "qwen2_text" the BPE tokenizer (trained once per test process) is written to `output_dir/tokenizer.json`,
    which the trainer loads as a resumed run would, instead of training it again in every run and on every rank.
    """
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
    shrink = SHRINK[kind]
    config = replace(
        config, model=shrink.get("model", {}), data={**shrink.get("data", {}), **(data or {})}, train=settings
    )
    if kind == "qwen2_text":
        tokenizer = Path(output_dir) / TOKENIZER_FILE
        tokenizer.parent.mkdir(parents=True, exist_ok=True)
        tokenizer.write_text(_pydoc_tokenizer_json(config.example.tokenizer_vocab_size))
    return config


def run_trainer(
    kind: str,
    config: Config,
    stop_after: int | None = None,
    setup: Callable[[BaseTrainer], None] | None = None,
) -> list[dict[str, Any]]:
    """Train; return the JSONL events. `stop_after=k` requests a stop (as SIGTERM would) after step k; `setup` is
    called with the built trainer before training (to wrap its methods for a test)."""
    trainer_cls, _ = TRAINERS[kind]
    trainer = trainer_cls(config)
    if setup is not None:
        setup(trainer)
    if stop_after is not None:
        stop_after_step(trainer, stop_after)
    try:
        trainer.train()
    except SystemExit as exc:
        if stop_after is None:
            raise
        assert exc.code == 128 + 15
    finally:
        trainer.metrics.close()
    return read_events(config.train.output_dir)


def stop_after_step(trainer: BaseTrainer, step: int) -> None:
    """Make `trainer` request a stop (as SIGTERM would) once it has trained step `step`."""
    original = trainer.train_step

    def train_step(micro_batches: list) -> None:
        original(micro_batches)
        if trainer.step == step:
            trainer._stop_signal = 15

    trainer.train_step = train_step


def train_built(trainer: BaseTrainer, stop_after: int | None = None) -> BaseTrainer:
    """Train a built trainer, stopped (as SIGTERM would) after step `stop_after` when given; the process group stays
    with its owner (the test's ranks)."""
    if stop_after is not None:
        stop_after_step(trainer, stop_after)
    try:
        trainer.train()
    except SystemExit as exc:
        assert stop_after is not None and exc.code == 128 + 15
    finally:
        trainer.metrics.close()
    return trainer


def train_outcome(trainer: BaseTrainer) -> str:
    """Train a built trainer: "trained", or the error this rank ended on (its metrics closed without a collective)."""
    try:
        trainer.train()
        return "trained"
    except BaseException as exc:  # noqa: BLE001 - the fault tests assert which error each rank raised
        return f"{type(exc).__name__}: {exc}"
    finally:
        trainer.metrics.abort(trainer.step)


def read_events(output_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses_by_step(events: list[dict[str, Any]], key: str = "train/loss") -> dict[int, float]:
    return {event["step"]: event[key] for event in events if key in event}


def ranked_run(rank: int, world_size: int, kind: str, config: Config) -> dict[int, float] | None:
    """Entry for `run_distributed`: every rank trains; rank 0 returns the per-step losses."""
    run_trainer(kind, config)
    return losses_by_step(read_events(config.train.output_dir)) if rank == 0 else None
