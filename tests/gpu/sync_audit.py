"""GPU audit of the real trainer step: `BaseTrainer.train_step` under `torch.cuda.set_sync_debug_mode("warn")`.

    torchrun --standalone --nproc_per_node N tests/gpu/sync_audit.py KIND DEMO_DIR [--sp S] [--steps K] [--out F]

KIND is `qwen2` (the help pages' Qwen2 directory) or `qwen2_vl` (the digits' Qwen2-VL directory), both written by
`sft_demo.write_demo(DEMO_DIR)`, trained through `SFTTrainer` with packing, a token budget, the fused LM head (the
default), NCCL and bf16 (`parallel.mixed_precision: auto`), and flash-attention varlen where flash-attn is installed
(else SDPA per sample). The loop here is the trainer's own (`shard`, `_agree`, `train_step`, `end_step`); only the
audit wraps it: every host sync inside `train_step` is counted as a warning, filed under "micro-batches" until the
step end starts (`clip_global_grad_norm`) and under "step end" after (the grad-norm verdict's host read and the
loss-key verdict, by design). Then the steps are timed without the audit (synchronized, the slowest rank's time).

Rank 0 prints and writes (`--out`) JSON: syncs per micro-batch (the contract is 0), syncs per step end, their sites,
and the step times. `--cpu-dry-run` runs the same code on gloo/CPU in fp32 without the audit, so every `make test`
exercises it. The exit code is 1 when a micro-batch synced.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script by torchrun: the repository's examples and the library

import veomni_lite.trainer.base as base  # noqa: E402
from veomni_lite.config import load_config  # noqa: E402
from veomni_lite.trainer.sft import SFTTrainer  # noqa: E402

CONFIGS = {
    "qwen2": ("sft_help.yaml", "qwen2_help", "help"),
    "qwen2_vl": ("sft_digits.yaml", "qwen2_vl_digits", "digits"),
}


class SyncAudit:
    """Counts the host syncs that `torch.cuda.set_sync_debug_mode("warn")` reports inside `step()`, by phase: the
    micro-batch loop until the step end's first call (`clip_global_grad_norm`), the step end after it."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.syncs: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()
        self.phase = "micro-batches"
        self._caught: list[warnings.WarningMessage] = []
        clip = base.clip_global_grad_norm

        def step_end(*args: Any, **kwargs: Any) -> Any:
            self._file()
            self.phase = "step end"
            return clip(*args, **kwargs)

        base.clip_global_grad_norm = step_end  # the trainer's own step calls it where its step end starts

    def _file(self) -> None:
        for warning in self._caught:
            # torch's own "called a synchronizing CUDA operation"; not set_sync_debug_mode's warning that the mode is a
            # prototype ("Synchronization debug mode ..."), which the first GPU run counted as a sync of the step
            if "called a synchronizing" in str(warning.message):
                self.syncs[self.phase] += 1
                self.sites[f"{self.phase}: {Path(warning.filename).name}:{warning.lineno}"] += 1
        self._caught.clear()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self.phase = "micro-batches"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self._caught = caught
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(0)
                self._file()


def build_trainer(kind: str, demo: Path, out: Path, sp: int, world: int, flash: bool) -> SFTTrainer:
    yaml, model, data = CONFIGS[kind]
    args = ["--model.pretrained_dir", str(demo / "models" / model), "--train.output_dir", str(out)]
    args += ["--data.train_path", str(demo / data / "train.jsonl")]
    if (demo / data / "eval.jsonl").is_file():  # a config's eval file is read even with evaluation off
        args += ["--data.eval_path", str(demo / data / "eval.jsonl")]
    args += ["--data.packing", "true", "--data.max_tokens_per_micro_batch", "512", "--parallel.sp_size", str(sp)]
    args += ["--train.max_steps", "1000", "--train.eval_interval", "0", "--checkpoint.save_interval", "0"]
    args += ["--logging.log_interval", "1", "--logging.progress_bar", "false", "--logging.plot", "false"]
    args += ["--logging.tensorboard", "false", "--logging.async_step_end", "false"]
    if flash:
        args += ["--model.attn_implementation", "flash_attention_2"]
    return SFTTrainer(load_config(REPO / "configs" / yaml, args, world_size=world))


def run_steps(trainer: SFTTrainer, count: int, audit: SyncAudit, device: torch.device) -> tuple[list[float], int]:
    """`count` steps of the trainer's own loop, each timed (synchronized); (times, micro-batches run)."""
    times, micro = [], 0
    for _ in range(count):
        micro_batches = [trainer.shard(mb) for mb in trainer.loader.next_step()]
        trainer._agree(micro_batches)
        micro += len(micro_batches)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with audit.step():
            trainer.train_step(micro_batches)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        trainer.epoch = trainer.loader.epoch
        trainer.metrics.end_step(trainer.step, trainer.epoch, release=micro_batches)
    return times, micro


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=sorted(CONFIGS))
    parser.add_argument("demo", type=Path, help="the directory sft_demo.write_demo wrote")
    parser.add_argument("--sp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5, help="audited steps, then as many timed")
    parser.add_argument("--out", type=Path, default=None, help="the JSON rank 0 writes")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/sync_audit"))
    parser.add_argument("--cpu-dry-run", action="store_true", help="gloo/CPU, fp32, no audit")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print("sync_audit: CUDA is not available here; run it on a CUDA machine or with --cpu-dry-run")
        return 0
    if args.cpu_dry_run:
        torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    from transformers.utils import is_flash_attn_2_available

    flash = not args.cpu_dry_run and is_flash_attn_2_available()
    trainer = build_trainer(args.kind, args.demo, args.output_dir / args.kind, args.sp, world, flash)
    device = trainer.device
    try:
        run_steps(trainer, 2, SyncAudit(False), device)  # kernels, communicators, AdamW state: not audited
        audit = SyncAudit(device.type == "cuda")
        _, micro = run_steps(trainer, args.steps, audit, device)
        times, _ = run_steps(trainer, args.steps, SyncAudit(False), device)
        slowest = torch.tensor(times, dtype=torch.float64)
        if world > 1:
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=trainer.control_group)
        result = {
            "kind": args.kind,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run: no audit)",
            "audited": audit.enabled,
            "world": world,
            "sp": args.sp,
            "attention": "flash_attention_2" if flash else "sdpa",
            "precision": "bf16" if device.type == "cuda" else "fp32",
            "steps": args.steps,
            "micro_batches": micro,
            "syncs_per_micro_batch": audit.syncs["micro-batches"] / micro,
            "syncs_per_step_end": audit.syncs["step end"] / args.steps,
            "sync_sites": dict(audit.sites),
            "step_time_s": {"median": statistics.median(slowest.tolist()), "all": slowest.tolist()},
            "trainer_step": trainer.step,
            "generated": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        }
    finally:
        trainer.close()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result, indent=1))
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if result["syncs_per_micro_batch"] else 0


if __name__ == "__main__":
    sys.exit(main())
