"""make bench: full fine-tuning against LoRA on the same job, 2 gloo ranks through the real SFT trainer.

The help-pages job (`configs/sft_help.yaml`, max_seq_len 256, 4 samples per micro-batch, 16 per step: GA 2) on a
Qwen2 directory of hidden size 512, 4 layers (14.7M parameters, written here with the job's tokenizer), trained
whole or with `model.lora` rank 8 on the attention and MLP projections. One torchrun launch per variant, so each
process's peak RSS is its own: reset (`/proc/self/clear_refs`) once the trainer is built, read (`VmHWM`) after the
steps, with glibc serving large blocks from mmap so freed tensors leave the resident set. Per rank: the optimizer
state's bytes (AdamW's moments of this rank's shards), the gradients' bytes at the optimizer step, the peak RSS
during the steps; the median step time, the max over ranks of each step after a warm-up step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LORA = "{rank: 8, alpha: 16, target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}"
MODEL = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8}
TARGET_OPTIMIZER_RATIO = 0.05  # LoRA's optimizer state over full fine-tuning's, at most


def write_model(work_dir: Path) -> Path:
    """The help pages and a Qwen2 directory of `MODEL`'s size (skipped where they exist)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from examples.sft_demo import write_help, write_tokenizer

    directory = work_dir / "qwen2_512"
    if not (directory / "config.json").is_file():
        tokenizer = write_tokenizer(directory, write_help(work_dir / "help"), vocab_size=2048)
        config = Qwen2Config(vocab_size=len(tokenizer), num_key_value_heads=4, max_position_embeddings=512, **MODEL)
        config.eos_token_id, config.pad_token_id, config.tie_word_embeddings = tokenizer.eos_token_id, 0, False
        AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    return directory


def _local_bytes(tensors: Any) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def _worker(work_dir: Path, variant: str, steps: int, out: Path) -> None:
    import torch.distributed as dist
    from packing import _peak_rss_mib, _reset_peak_rss

    from veomni_lite.config import load_config
    from veomni_lite.trainer.sft import SFTTrainer

    args = [
        "--model.pretrained_dir", str(work_dir / "qwen2_512"), "--data.train_path", str(work_dir / "help/train.jsonl"),
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
    _reset_peak_rss()
    seconds = []
    for _ in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step([trainer.shard(micro_batch) for micro_batch in trainer.loader.next_step()])
        seconds.append(time.perf_counter() - start)
    peak = _peak_rss_mib()
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


def measure(work_dir: Path, steps: int = 5, timeout_s: float = 900) -> dict[str, Any]:
    """Per variant: the largest per-rank optimizer-state and gradient bytes and peak RSS, the median step time."""
    work_dir.mkdir(parents=True, exist_ok=True)
    write_model(work_dir)
    variants = {}
    for variant in ("full", "lora"):
        out = work_dir / f"{variant}.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__]
        command += ["--worker", variant, "--work-dir", str(work_dir), "--steps", str(steps), "--out", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MALLOC_MMAP_THRESHOLD_": "65536"}
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
        result = json.loads(out.read_text())
        ranks = result.pop("ranks")
        step_s = [max(values) for values in zip(*(rank["seconds"] for rank in ranks))]
        per_rank = {key: max(rank[key] for rank in ranks) for key in ("optimizer_bytes", "grad_bytes", "peak_rss_mib")}
        variants[variant] = {**result, **per_rank, "median_ms": statistics.median(step_s) * 1e3}
    full, lora = variants["full"], variants["lora"]
    saved_mib = (full["optimizer_bytes"] + full["grad_bytes"] - lora["optimizer_bytes"] - lora["grad_bytes"]) / 2**20
    return {
        "steps": steps, "model": MODEL, "lora": LORA, "variants": variants, "target": TARGET_OPTIMIZER_RATIO,
        "optimizer_ratio": lora["optimizer_bytes"] / full["optimizer_bytes"], "state_and_grads_saved_mib": saved_mib,
        "peak_saved_mib": full["peak_rss_mib"] - lora["peak_rss_mib"],
    }  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["full", "lora"])
    parser.add_argument("--work-dir", type=Path, default=REPO / "benchmarks" / "results" / "raw" / "lora")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
    if args.worker:
        _worker(args.work_dir, args.worker, args.steps, args.out)
    else:
        print(json.dumps(measure(args.work_dir, args.steps), indent=1))
