"""make bench: SFT jobs padded against packed with token-budget micro-batches, at equal gradients (each step trains on
the same global batch either way; `tests/data/test_sft_packing.py` checks that the per-step losses and
gradient norms are equal): the help pages (`configs/sft_help.yaml`, one paragraph per row, so lengths vary; budget
512) and conversations (the same model, rows of 20 to 1,500 tokens drawn uniformly from spans of the help pages;
budgets 1,536 and 4,096).

Time: one process, the two variants in interleaved blocks of steps on the same trainer; a step is the trainer's own
(fetch this rank's micro-batches, shard, `train_step`). Real tokens are the samples' own (`sequence_ids` >= 0),
identical for both, so real tokens per second is their count over the step time; the padding ratio is padding positions
over all positions run; the spread is the lowest and highest packed / padded ratio of single blocks. Peak memory (CPU:
activations are part of the resident set): the process's peak RSS is reset before each block (`/proc/self/clear_refs`)
and read after it (`VmHWM`), so each variant's peak is its own steps' (model, optimizer and data included, the same for
both).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from harness import peak_rss_mib, prose, reset_peak_rss

REPO = Path(__file__).resolve().parents[1]
BUDGET = 512  # tokens per packed micro-batch: two to the longest sample (max_seq_len 256)
TARGET = 1.5  # packed real tokens per second over padded (the help pages; 1.0 for the conversations)
CHAT_BUDGETS, CHAT_TARGET, CHAT_LENGTHS = (1536, 4096), 1.0, (20, 1500)


def _write_conversations(path: Path, tokenizer: Any, rows: int = 512, seed: int = 0) -> None:
    """`rows` sharegpt rows whose answers are spans of the help pages' tokens, 20 to 1,500 tokens per row."""
    from pydoc_data.topics import topics

    ids = tokenizer("\n\n".join(topics[name] for name in sorted(topics)))["input_ids"]
    rng, out = random.Random(seed), []
    for _ in range(rows):
        length = rng.randint(CHAT_LENGTHS[0], CHAT_LENGTHS[1] - 16)  # the chat template adds about a dozen
        start = rng.randrange(len(ids) - length)
        answer = tokenizer.decode(ids[start : start + length])
        out.append({"conversations": [{"from": "human", "value": "Go on."}, {"from": "gpt", "value": answer}]})
    path.write_text("".join(json.dumps(row) + "\n" for row in out))


def _trainer(work_dir: Path, max_steps: int, chat: bool, global_batch: int) -> Any:
    from examples.sft_demo import write_demo
    from veomni_lite.config import load_config
    from veomni_lite.trainer.sft import SFTTrainer

    demo = write_demo(work_dir / "sft_demo")
    data = demo / "help/train.jsonl"
    if chat:
        from transformers import AutoTokenizer

        data = work_dir / "conversations.jsonl"
        _write_conversations(data, AutoTokenizer.from_pretrained(demo / "models/qwen2_help", local_files_only=True))
    args = [
        "--model.pretrained_dir", str(demo / "models/qwen2_help"), "--data.train_path", str(data),
        "--data.max_seq_len", str(CHAT_LENGTHS[1] if chat else 256), "--train.output_dir", str(work_dir / "run"),
        "--train.eval_batches", "0", "--train.max_steps", str(max_steps), "--train.global_batch_size",
        str(global_batch), "--checkpoint.save_interval", "0", "--logging.progress_bar", "false",
        "--logging.tensorboard", "false", "--logging.plot", "false",
    ]  # fmt: skip
    return SFTTrainer(load_config(REPO / "configs" / "sft_help.yaml", args, world_size=1))


def _loaders(trainer: Any, budgets: tuple[int, ...]) -> dict[str, Any]:
    from veomni_lite.data.collator import collate
    from veomni_lite.data.loader import MicroBatchLoader

    train = trainer.config.train
    common = {"global_batch_size": train.global_batch_size, "micro_batch_size": train.micro_batch_size, "seed": 0}
    loaders = {"padded": MicroBatchLoader(trainer.train_dataset, trainer.collate, **common)}
    for budget in budgets:
        loaders[f"packed {budget}"] = MicroBatchLoader(
            trainer.train_dataset,
            lambda samples: collate(samples, pad_id=trainer.pad_id, packing=True),
            **common,
            max_tokens=budget,
            packing=True,
        )
    return loaders


def _step(trainer: Any, loader: Any) -> tuple[float, int, int, int]:
    """(seconds, real tokens, positions, micro-batches) of one trainer step."""
    start = time.perf_counter()
    micro_batches = [trainer.shard(micro_batch) for micro_batch in loader.next_step()]
    trainer.train_step(micro_batches)
    seconds = time.perf_counter() - start
    real = sum(int((mb["sequence_ids"] >= 0).sum()) for mb in micro_batches)
    return seconds, real, sum(mb["input_ids"].numel() for mb in micro_batches), len(micro_batches)


def block(work_dir: Path, quick: bool) -> dict[str, Any]:
    """The help pages (budget 512) and the conversations (budgets 1,536 and 4,096, rows ten times longer, so a tenth
    of the steps), interleaved blocks of steps on one thread; quick: fewer steps and blocks, conversations of 8."""
    import torch

    steps, blocks, chat_batch = (3, 2, 8) if quick else (20, 4, 32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the bench workers (OMP_NUM_THREADS=1): a shared machine's threads stall each other
    try:
        jobs = [_measure_job(work_dir, "help pages", steps, blocks, (BUDGET,), 32)]
        jobs.append(_measure_job(work_dir, "conversations", max(1, steps // 10), blocks, CHAT_BUDGETS, chat_batch))
    finally:
        torch.set_num_threads(threads)
    rows, targets = [], []
    for job in jobs:
        for name, v in job["variants"].items():
            step_ms = f"{v['median_ms']:.0f} [{v['q1_ms']:.0f}–{v['q3_ms']:.0f}]"
            cells = [
                v["micro_batches_per_step"],
                step_ms,
                v["real_tokens_per_s"],
                v["padding_ratio"],
                v["peak_rss_mib"],
            ]
            rows.append([job["job"], "{}–{}".format(*job["lengths"]), job["global_batch_size"], name, *cells])
        for budget, per_block in job["speedups"].items():
            name = f"packed {budget} / padded real tokens/s, {job['job']}"
            bound = TARGET if job["job"] == "help pages" else CHAT_TARGET
            targets.append({"name": name, "op": ">=", "bound": bound, "unit": "x", "values": per_block})
    columns = ["job", "sample tokens", "global batch", "variant", "micro-batches per step", "step ms median [IQR]"]
    columns += ["real tokens/s", "padding ratio", "peak RSS MiB"]
    about = prose(__doc__) + (
        f" Steps per block: {jobs[0]['steps'] // blocks} (help pages), {jobs[1]['steps'] // blocks} (conversations); "
        f"{blocks} blocks; a target's values are the blocks' packed / padded ratios."
    )
    return {
        "title": "Packing against padding",
        "about": about,
        "tables": [{"columns": columns, "rows": rows}],
        "targets": targets,
    }


def _measure_job(
    work_dir: Path, job: str, steps: int, blocks: int, budgets: tuple[int, ...], global_batch: int
) -> dict[str, Any]:
    """Per variant: median [IQR] step ms, real tokens per second, padding ratio, micro-batches per step, peak RSS;
    per budget the packed / padded real tokens per second, overall and its lowest and highest block."""
    trainer = _trainer(work_dir, 10 * steps * blocks, job != "help pages", global_batch)
    loaders = _loaders(trainer, budgets)
    rows: dict[str, list[tuple[float, int, int, int]]] = {name: [] for name in loaders}
    speeds: dict[str, list[float]] = {name: [] for name in loaders}
    peaks = {name: 0.0 for name in loaders}
    try:
        for _ in range(blocks):
            for name, loader in loaders.items():
                reset_peak_rss()
                block = [_step(trainer, loader) for _ in range(steps + 1)][1:]  # the first step warms up
                rows[name] += block
                speeds[name].append(sum(v[1] for v in block) / sum(v[0] for v in block))
                peaks[name] = max(peaks[name], peak_rss_mib())
    finally:
        trainer.close()
    lengths = [len(trainer.train_dataset[i]["input_ids"]) for i in range(min(len(trainer.train_dataset), 512))]
    out: dict[str, Any] = {"job": job, "steps": steps * blocks, "variants": {}, "speedups": {}}
    out["global_batch_size"] = trainer.config.train.global_batch_size
    out["micro_batch_size"] = trainer.config.train.micro_batch_size
    out["lengths"] = [min(lengths), max(lengths)]
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
    for budget in budgets:
        name = f"packed {budget}"
        out["speedups"][str(budget)] = [p / q for p, q in zip(speeds[name], speeds["padded"])]
    print(f"[bench] packing, {job}: {out['speedups']}", flush=True)
    return out
