"""make bench: what scales with the mesh. Two measurements, each a set of torchrun launches of this file (gloo,
OMP_NUM_THREADS=1), through the real trainer:

- Scaling: the tiny VLM (`configs/vlm_tiny.yaml`) at world 2, 4 and 8, GA 1, 4 and 16, two samples per micro-batch.
  Per step: the loss all-reduces and host reads inside `postforward` (where the loss is normalized), the whole step's
  collectives and host reads (the grad-norm verdict is its one planned read), and the median step time (the max over
  ranks of each step). The machine has fewer cores than the larger worlds have processes, so their step time
  includes the processes' time-sharing.
- Memory: a Qwen2 causal LM (`configs/qwen2_text.yaml`, transformers) at two sizes on 2 ranks, GA 2, for each memory
  choice: gradient sync on the last micro-batch only (the old behaviour) or every micro-batch, the cross-entropy in
  one piece or chunked, activation checkpointing off or on. One launch per row, so each process's peak RSS is its
  own (reset by `/proc/self/clear_refs` after the trainer is built, read as `VmHWM` after the steps): the growth is
  what training adds on top of the model (activations, gradients, optimizer state); glibc is told to serve large
  blocks from mmap, so freed tensors leave the resident set. The per-step losses of every row are compared with the
  first row's.
- Build: the same model and sizes at the default choice, built whole on every rank (`model.load_sharded false`) or
  on rank 0 only and scattered into the shards (the default): each rank's peak RSS from the end of `build_datasets`
  to the built trainer (the model, its shards, the optimizer, the loader) over its RSS there, the model's modules
  imported before (by a build on the meta device), and the per-step losses against the whole build's.
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
WORLDS = (2, 4, 8)
GAS = (1, 4, 16)
SIZES = {  # model.hf.* of the memory rows
    "small": {"hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4},
    "large": {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 8},
}
CHOICES = {  # name: (parallel.gradient_sync, cross-entropy chunk tokens, parallel.activation_checkpointing)
    "sync last, CE whole": ("last_micro_batch", 0, False),
    "sync every micro-batch, CE whole": ("every_micro_batch", 0, False),
    "sync every, CE chunked": ("every_micro_batch", 256, False),
    "sync every, CE chunked, recompute": ("every_micro_batch", 256, True),
}
BUILDS = {  # name: model.load_sharded, at the default choice (the second row of CHOICES)
    "whole on every rank": False,
    "rank 0 only, scattered": True,
}
MEMORY_STEPS = 2
SEQ_LEN = 512


# ---------------------------------------------------------------- workers (one torchrun process each)


def _quiet(output_dir: Path) -> list[str]:
    return [
        "--train.output_dir", str(output_dir),
        "--train.eval_interval", "0",
        "--train.max_steps", "1000",
        "--checkpoint.save_interval", "0",
        "--logging.log_interval", "1000",
        "--logging.progress_bar", "false",
        "--logging.tensorboard", "false",
        "--logging.plot", "false",
    ]  # fmt: skip


def _one_step(trainer: Any) -> list[Any]:
    micro_batches = [trainer.shard(micro_batch) for micro_batch in trainer.loader.next_step()]
    trainer._agree(micro_batches)
    trainer.train_step(micro_batches)
    return micro_batches


def _scaling_worker(out: Path, steps: int) -> None:
    import torch.distributed as dist
    from harness import OpCounter, max_over_ranks

    from examples.vlm_trainer import VLMTrainer
    from veomni_lite.config import load_config

    world = int(os.environ["WORLD_SIZE"])
    rows = []
    for ga in GAS:
        work = out.parent / f"scaling_{world}_{ga}"  # one directory all ranks share
        args = [*_quiet(work), "--train.micro_batch_size", "2", "--train.global_batch_size", str(2 * world * ga)]
        trainer = VLMTrainer(load_config(REPO / "configs" / "vlm_tiny.yaml", args, world_size=world))
        counter = OpCounter()
        postforward = trainer.postforward

        def counted_postforward(*args: Any, counter: OpCounter = counter, postforward: Any = postforward) -> Any:
            with counter.phase("loss"):
                return postforward(*args)

        trainer.postforward = counted_postforward
        _one_step(trainer)  # warm-up
        with counter.active():
            _one_step(trainer)
        trainer.metrics.wait_bookkeeping()
        counts = counter.snapshot(1)
        seconds = []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            _one_step(trainer)
            seconds.append(time.perf_counter() - start)
        seconds = max_over_ranks(seconds)
        trainer.metrics.finish(trainer.step, 0)
        trainer.loader.close()
        rows.append(
            {
                "world": world,
                "ga": ga,
                "loss_collectives": counts["collectives"].get("loss", 0.0),
                "loss_host_reads": counts["host_reads"].get("loss", 0.0),
                "step_collectives": sum(counts["collectives"].values()),
                "step_host_reads": sum(counts["host_reads"].values()),
                "median_ms": statistics.median(seconds) * 1e3,
            }
        )
    if dist.get_rank() == 0:
        out.write_text(json.dumps(rows))
    dist.destroy_process_group()


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _memory_worker(out: Path, size: str, choice: str, load_sharded: bool) -> None:
    import torch
    import torch.distributed as dist
    from packing import _peak_rss_mib, _reset_peak_rss

    from examples.qwen2_pydoc_text import TOKENIZER_FILE, PydocLMTrainer
    from veomni_lite.config import load_config
    from veomni_lite.models import heads

    sync, chunk, recompute = CHOICES[choice]
    heads.CE_CHUNK_TOKENS = chunk
    work = out.parent / f"memory_{size}_{list(CHOICES).index(choice)}_{load_sharded}"
    shared_tokenizer = out.parent / TOKENIZER_FILE
    args = [*_quiet(work), "--train.micro_batch_size", "4", "--train.global_batch_size", "16"]
    args += ["--data.seq_len", str(SEQ_LEN), "--parallel.gradient_sync", sync]
    args += ["--parallel.activation_checkpointing", str(recompute).lower()]
    args += ["--model.load_sharded", str(load_sharded).lower()]
    for key, value in SIZES[size].items():
        args += [f"--model.hf.{key}", str(value)]
    if os.environ["RANK"] == "0" and shared_tokenizer.exists():  # trained once, by the first row
        work.mkdir(parents=True, exist_ok=True)
        (work / TOKENIZER_FILE).write_bytes(shared_tokenizer.read_bytes())
    config = load_config(REPO / "configs" / "qwen2_text.yaml", args, world_size=2)
    rss: list[float] = []

    class Measured(PydocLMTrainer):
        def build_datasets(self) -> Any:  # the trainer builds its model next: measure from here
            datasets = super().build_datasets()
            self.train_dataset = datasets[0]
            with torch.device("meta"):  # imports the model's modules, so the measure holds tensors only
                self.build_model()
            rss.append(_rss_mib())
            _reset_peak_rss()
            return datasets

    trainer = Measured(config)
    build = _peak_rss_mib() - rss[0]
    losses: list[float] = []
    postforward = trainer.postforward

    def recorded(*args: Any) -> Any:
        loss, scaled = postforward(*args)
        losses.append(loss.detach())
        return loss, scaled

    trainer.postforward = recorded
    parameters = sum(p.numel() for p in trainer.model.parameters())  # a DTensor's numel is the whole tensor's
    before = _peak_rss_mib()
    _reset_peak_rss()
    per_step = []
    for _ in range(MEMORY_STEPS):
        count = len(losses)
        micro_batches = _one_step(trainer)
        per_step.append(float(sum(losses[count:])))
        del micro_batches
    growth = _peak_rss_mib() - before
    trainer.metrics.finish(trainer.step, 0)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, {"build_mib": build, "growth_mib": growth, "losses": per_step})
    if dist.get_rank() == 0:
        if not shared_tokenizer.exists():
            shared_tokenizer.write_bytes((work / TOKENIZER_FILE).read_bytes())
        out.write_text(json.dumps({"size": size, "choice": choice, "parameters": parameters, "ranks": peaks}))
    dist.barrier()  # both ranks tear the process group down together
    trainer.close()


# ---------------------------------------------------------------- the orchestrator (make bench)


def _launch(world: int, args: list[str], timeout_s: float) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
    command += [str(Path(__file__).resolve()), *args]
    # Large blocks from mmap, returned to the system when freed, so the peak RSS follows the live tensors.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} exited with {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )


def measure(work_dir: Path, steps: int = 5, timeout_s: float = 600, worlds: tuple[int, ...] = WORLDS) -> dict[str, Any]:
    """{"scaling": [per world and GA], "memory": [per size and choice], "steps": ...}."""
    work_dir.mkdir(parents=True, exist_ok=True)
    scaling = []
    for world in worlds:
        out = work_dir / f"scaling_{world}.json"
        _launch(world, ["--worker", "scaling", "--out", str(out), "--steps", str(steps)], timeout_s)
        scaling += json.loads(out.read_text())
        print(f"[bench] scaling: world {world} done", flush=True)
    memory = []
    for size in SIZES:
        for choice in CHOICES:
            out = work_dir / "memory.json"
            _launch(2, ["--worker", "memory", "--out", str(out), "--size", size, "--choice", choice], timeout_s)
            memory.append(json.loads(out.read_text()))
        print(f"[bench] memory: {size} done", flush=True)
    builds = []
    for size in SIZES:
        for name, load_sharded in BUILDS.items():
            out = work_dir / "build.json"
            args = ["--worker", "memory", "--out", str(out), "--size", size, "--choice", list(CHOICES)[1]]
            _launch(2, [*args, "--load-sharded", str(load_sharded).lower()], timeout_s)
            builds.append({**json.loads(out.read_text()), "build": name})
        print(f"[bench] build: {size} done", flush=True)
    for rows in (memory, builds):
        for row in rows:
            first = next(r for r in rows if r["size"] == row["size"])
            row["loss_max_rel_diff"] = max(
                abs(a - b) / abs(b) for mine, theirs in zip(row["ranks"], first["ranks"])
                for a, b in zip(mine["losses"], theirs["losses"])
            )  # fmt: skip
    return {
        "steps": steps, "memory_steps": MEMORY_STEPS, "seq_len": SEQ_LEN, "scaling": scaling, "memory": memory,
        "builds": builds,
    }  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["scaling", "memory"])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--size", choices=list(SIZES))
    parser.add_argument("--choice", choices=list(CHOICES))
    parser.add_argument("--load-sharded", choices=["true", "false"], default="true")
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="scaling world sizes ('' for none)")
    parser.add_argument("--work-dir", type=Path, default=REPO / "benchmarks" / "results" / "raw" / "many_machines")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
    if args.worker == "scaling":
        _scaling_worker(args.out, args.steps)
    elif args.worker == "memory":
        _memory_worker(args.out, args.size, args.choice, args.load_sharded == "true")
    else:
        worlds = tuple(int(world) for world in args.worlds.split(",") if world)
        print(json.dumps(measure(args.work_dir, args.steps, worlds=worlds), indent=1))
