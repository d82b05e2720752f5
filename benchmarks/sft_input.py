"""make bench: the SFT digits job (`configs/sft_digits.yaml`, what `make train-sft` trains) with and without the
input pipeline's prefetch thread, in one process, in interleaved blocks of steps.

A step here is what the trainer's loop does per optimizer step: fetch this rank's micro-batches from the loader
(reading rows, decoding PNGs, the image processor, collating), shard them, and `train_step`. With
`data.prefetch_steps` 1 the next step's fetch runs on the background thread while this step trains. The first step
of each block is not timed (nothing was fetched ahead for it).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def measure(work_dir: Path, steps: int = 20, blocks: int = 4) -> dict[str, Any]:
    """{"steps": timed steps per variant, "median_ms": {without, with}, "q1_ms", "q3_ms"} (see the module docstring)."""
    from examples.sft_demo import write_demo
    from veomni_lite.config import load_config
    from veomni_lite.trainer.sft import SFTTrainer

    demo = write_demo(work_dir / "sft_demo")
    args = [
        "--model.pretrained_dir", str(demo / "models/qwen2_vl_digits"),
        "--data.train_path", str(demo / "digits/train.jsonl"),
        "--data.eval_path", str(demo / "digits/eval.jsonl"),
        "--train.output_dir", str(work_dir / "sft_run"),
        "--train.eval_batches", "0",
        "--train.max_steps", str(10 * steps * blocks),
        "--logging.progress_bar", "false",
        "--logging.tensorboard", "false",
        "--logging.plot", "false",
    ]  # fmt: skip
    trainer = SFTTrainer(load_config(REPO / "configs" / "sft_digits.yaml", args, world_size=1))
    loaders = {
        name: trainer._make_loader(trainer.train_dataset, 0, ahead) for name, ahead in (("without", 0), ("with", 1))
    }
    times: dict[str, list[float]] = {name: [] for name in loaders}
    try:
        for _ in range(blocks):
            for name, loader in loaders.items():
                for index in range(steps + 1):
                    start = time.perf_counter()
                    trainer.train_step([trainer.shard(micro_batch) for micro_batch in loader.next_step()])
                    if index:
                        times[name].append(time.perf_counter() - start)
    finally:
        for loader in loaders.values():
            loader.close()
        trainer.close()
    quartiles = {name: statistics.quantiles(values, n=4) for name, values in times.items()}
    return {
        "steps": steps * blocks,
        "micro_batch_size": trainer.config.train.micro_batch_size,
        "global_batch_size": trainer.config.train.global_batch_size,
        "median_ms": {name: statistics.median(values) * 1e3 for name, values in times.items()},
        "q1_ms": {name: q[0] * 1e3 for name, q in quartiles.items()},
        "q3_ms": {name: q[2] * 1e3 for name, q in quartiles.items()},
    }
