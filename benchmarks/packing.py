"""make bench: the help-pages SFT job (`configs/sft_help.yaml`, one paragraph per row, so lengths vary) padded against
packed with token-budget micro-batches, at equal gradients (each step trains on the same global batch of 32 samples
either way; `tests/data/test_sft_packing.py` checks that the per-step losses and gradient norms are equal).

Time: one process, the two variants in interleaved blocks of steps on the same trainer; a step is the trainer's own
(fetch this rank's micro-batches, shard, `train_step`). Real tokens are the samples' own (`sequence_ids` >= 0),
identical for both, so real tokens per second is their count over the step time; the padding ratio is padding
positions over all positions run. Peak memory (CPU: activations are part of the resident set): the process's peak
RSS is reset before each block (`/proc/self/clear_refs`) and read after it (`VmHWM`), so each variant's peak is
its own steps' (model, optimizer and data included, the same for both).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BUDGET = 512  # tokens per packed micro-batch: two to the longest sample (max_seq_len 256)
TARGET = 1.5  # packed real tokens per second over padded


def _trainer(work_dir: Path, max_steps: int) -> Any:
    from veomni_lite.config import load_config
    from veomni_lite.examples.sft_demo import write_demo
    from veomni_lite.trainer.sft import SFTTrainer

    demo = write_demo(work_dir / "sft_demo")
    args = [
        "--model.pretrained_dir", str(demo / "models/qwen2_help"),
        "--data.train_path", str(demo / "help/train.jsonl"),
        "--train.output_dir", str(work_dir / "packing_run"),
        "--train.eval_batches", "0",
        "--train.max_steps", str(max_steps),
        "--checkpoint.save_interval", "0",
        "--logging.progress_bar", "false",
        "--logging.tensorboard", "false",
        "--logging.plot", "false",
    ]  # fmt: skip
    return SFTTrainer(load_config(REPO / "configs" / "sft_help.yaml", args, world_size=1))


def _loaders(trainer: Any) -> dict[str, Any]:
    from veomni_lite.data.collator import collate
    from veomni_lite.data.loader import MicroBatchLoader

    train = trainer.config.train
    common = {"global_batch_size": train.global_batch_size, "micro_batch_size": train.micro_batch_size, "seed": 0}
    return {
        "padded": MicroBatchLoader(trainer.train_dataset, trainer.collate, **common),
        "packed": MicroBatchLoader(
            trainer.train_dataset,
            lambda samples: collate(samples, pad_id=trainer.pad_id, packing=True),
            **common,
            max_tokens=BUDGET,
            packing=True,
        ),
    }


def _step(trainer: Any, loader: Any) -> tuple[float, int, int, int]:
    """(seconds, real tokens, positions, micro-batches) of one trainer step."""
    start = time.perf_counter()
    micro_batches = [trainer.shard(micro_batch) for micro_batch in loader.next_step()]
    trainer.train_step(micro_batches)
    seconds = time.perf_counter() - start
    real = sum(int((mb["sequence_ids"] >= 0).sum()) for mb in micro_batches)
    return seconds, real, sum(mb["input_ids"].numel() for mb in micro_batches), len(micro_batches)


def measure(work_dir: Path, steps: int = 20, blocks: int = 4) -> dict[str, Any]:
    """Per variant: median [IQR] step ms, real tokens per second, padding ratio, micro-batches per step, peak RSS."""
    trainer = _trainer(work_dir, 10 * steps * blocks)
    loaders = _loaders(trainer)
    rows: dict[str, list[tuple[float, int, int, int]]] = {name: [] for name in loaders}
    peaks = {name: 0.0 for name in loaders}
    try:
        for _ in range(blocks):
            for name, loader in loaders.items():
                _reset_peak_rss()
                for index in range(steps + 1):
                    row = _step(trainer, loader)
                    if index:  # the first step of a block warms the variant up
                        rows[name].append(row)
                peaks[name] = max(peaks[name], _peak_rss_mib())
    finally:
        trainer.close()
    out: dict[str, Any] = {"steps": steps * blocks, "budget": BUDGET, "target": TARGET, "variants": {}}
    out["global_batch_size"] = trainer.config.train.global_batch_size
    out["micro_batch_size"] = trainer.config.train.micro_batch_size
    for name, values in rows.items():
        seconds = [v[0] for v in values]
        q1, median, q3 = statistics.quantiles(seconds, n=4)
        real, positions = sum(v[1] for v in values), sum(v[2] for v in values)
        out["variants"][name] = {
            "median_ms": median * 1e3,
            "q1_ms": q1 * 1e3,
            "q3_ms": q3 * 1e3,
            "real_tokens_per_s": real / sum(seconds),
            "padding_ratio": 1 - real / positions,
            "micro_batches_per_step": statistics.mean(v[3] for v in values),
            "peak_rss_mib": peaks[name],
        }
    padded, packed = out["variants"]["padded"], out["variants"]["packed"]
    out["speedup"] = packed["real_tokens_per_s"] / padded["real_tokens_per_s"]
    return out


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=REPO / "benchmarks" / "results" / "raw" / "packing")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--blocks", type=int, default=4)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    print(json.dumps(measure(args.work_dir, args.steps, args.blocks), indent=1))
