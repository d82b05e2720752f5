"""make bench: full fine-tuning against LoRA on the same job, 2 gloo ranks through the real SFT trainer.

The help-pages job (`configs/sft_help.yaml`, max_seq_len 256, 4 samples per micro-batch, 16 per step: GA 2) on a Qwen2
directory of hidden size 512, 4 layers (14.7M parameters; quick: 256, 2 layers; written here with the job's
tokenizer), trained whole or with `model.lora` rank 8 on the attention and MLP projections. One torchrun launch per
variant, so each process's peak RSS is its own: reset (`/proc/self/clear_refs`) once the trainer is built, read
(`VmHWM`) after the steps, with glibc serving large blocks from mmap so freed tensors leave the resident set. Per
rank: the optimizer state's bytes (AdamW's moments of this rank's shards), the gradients' bytes at the optimizer step,
the peak RSS during the steps; the median step time, the max over ranks of each step after a warm-up step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LORA = "{rank: 8, alpha: 16, target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}"
MODEL = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8}
QUICK_MODEL = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2, "num_attention_heads": 8}
TARGET_OPTIMIZER_RATIO = 0.05  # LoRA's optimizer state over full fine-tuning's, at most


def write_model(work_dir: Path, model: dict[str, int]) -> Path:
    """The help pages and a Qwen2 directory of `model`'s size (skipped where they exist)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from examples.sft_demo import write_help, write_tokenizer

    directory = work_dir / f"qwen2_{model['hidden_size']}x{model['num_hidden_layers']}"
    if not (directory / "config.json").is_file():
        tokenizer = write_tokenizer(directory, write_help(work_dir / "help"), vocab_size=2048)
        config = Qwen2Config(vocab_size=len(tokenizer), num_key_value_heads=4, max_position_embeddings=512, **model)
        config.eos_token_id, config.pad_token_id, config.tie_word_embeddings = tokenizer.eos_token_id, 0, False
        AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    return directory


def _local_bytes(tensors: Any) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def _worker(work_dir: Path, model_dir: Path, variant: str, steps: int, out: Path) -> None:
    import torch.distributed as dist
    from harness import peak_rss_mib, reset_peak_rss

    from veomni_lite.config import load_config
    from veomni_lite.trainer.sft import SFTTrainer

    args = [
        "--model.pretrained_dir", str(model_dir), "--data.train_path", str(work_dir / "help/train.jsonl"),
        "--train.output_dir", str(work_dir / f"run_{variant}"), "--train.micro_batch_size", "4",
        "--train.global_batch_size", "16", "--train.eval_interval", "0", "--train.max_steps", "1000",
        "--checkpoint.save_interval", "0", "--logging.log_interval", "1000", "--logging.progress_bar", "false",
        "--logging.tensorboard", "false", "--logging.plot", "false",
        "--model.lora", LORA if variant == "lora" else "{}",
    ]  # fmt: skip
    trainer = SFTTrainer(
        load_config(REPO / "configs" / "sft_help.yaml", args, world_size=int(os.environ["WORLD_SIZE"]))
    )
    grads: list[int] = []
    step = trainer.optimizer.step

    def counted_step(*a: Any, **k: Any) -> Any:
        grads.append(_local_bytes(p.grad for p in trainer.model.parameters() if p.grad is not None))
        return step(*a, **k)

    trainer.optimizer.step = counted_step
    reset_peak_rss()
    seconds = []
    for _ in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step([trainer.shard(micro_batch) for micro_batch in trainer.loader.next_step()])
        seconds.append(time.perf_counter() - start)
    peak = peak_rss_mib()
    state = _local_bytes(v for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step")
    row = {"optimizer_bytes": state, "grad_bytes": grads[-1], "peak_rss_mib": peak, "seconds": seconds[1:]}
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in trainer.model.parameters())
        trained = sum(p.numel() for p in trainer.trainable)
        out.write_text(json.dumps({"ranks": rows, "parameters": params, "trained": trained}))
    trainer.metrics.finish(trainer.step, 0)
    trainer.close()


def block(work_dir: Path, quick: bool) -> dict[str, Any]:
    """Per variant: the largest per-rank optimizer-state and gradient bytes and peak RSS, the median step time."""
    from harness import prose, torchrun

    model, steps = (QUICK_MODEL, 1) if quick else (MODEL, 5)
    work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = write_model(work_dir, model)
    variants = {}
    for variant in ("full", "lora"):
        out = work_dir / f"{variant}.json"
        args = ["--worker", variant, "--work-dir", str(work_dir), "--model-dir", str(model_dir), "--steps", str(steps)]
        torchrun(Path(__file__), 2, [*args, "--out", str(out)], 900, {"MALLOC_MMAP_THRESHOLD_": "65536"})
        result = json.loads(out.read_text())
        ranks = result.pop("ranks")
        step_s = [max(values) for values in zip(*(rank["seconds"] for rank in ranks))]
        per_rank = {key: max(rank[key] for rank in ranks) for key in ("optimizer_bytes", "grad_bytes", "peak_rss_mib")}
        variants[variant] = {**result, **per_rank, "median_ms": statistics.median(step_s) * 1e3}
    rows = [
        [name, v["parameters"], v["trained"], v["optimizer_bytes"] / 2**20, v["grad_bytes"] / 2**20]
        + [v["peak_rss_mib"], v["median_ms"]]
        for name, v in variants.items()
    ]
    full, lora = variants["full"], variants["lora"]
    ratio = lora["optimizer_bytes"] / full["optimizer_bytes"]
    target = {"name": "LoRA / full optimizer state per rank", "op": "<=", "bound": TARGET_OPTIMIZER_RATIO * 100}
    columns = ["variant", "parameters", "trained", "optimizer state MiB per rank", "gradients MiB per rank"]
    columns += ["peak RSS MiB per rank", "step ms (median)"]
    about = prose(__doc__) + f" {steps} timed steps after a warm-up step; LoRA: `{LORA}`."
    return {
        "title": "LoRA against full fine-tuning",
        "about": about,
        "tables": [{"columns": columns, "rows": rows}],
        "targets": [target | {"unit": "%", "values": [ratio * 100]}],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["full", "lora"])
    parser.add_argument("--work-dir", type=Path, default=REPO / "benchmarks" / "results" / "raw" / "lora")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
    if args.worker:
        _worker(args.work_dir, args.model_dir, args.worker, args.steps, args.out)
    else:
        print(json.dumps(block(args.work_dir, quick=False), indent=1))
