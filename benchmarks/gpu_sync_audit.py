"""GPU host-sync audit: veomni_lite's micro-batch loop under `torch.cuda.set_sync_debug_mode("error")`, with NCCL.

Run on a CUDA machine (one process per GPU; SP must divide the world size and the 4 attention heads):
    torchrun --standalone --nproc_per_node 2 benchmarks/gpu_sync_audit.py --sp 1 --out docs/benchmarks_gpu.json
    torchrun --standalone --nproc_per_node 2 benchmarks/gpu_sync_audit.py --sp 2 --out docs/benchmarks_gpu_sp2.json
What it checks: per micro-batch `count_loss_token`, the tiny VLM forward (Ulysses all-to-alls under SP),
`mean_global_loss`, backward and the trainer's per-micro-batch metric records (`MetricAccumulator.record`), with the
step's `count_loss_token` before them, must not synchronize the host with the device. The step end (gradient
all-reduce, `verify_loss_keys`, optimizer, the log-time metric reduce) has its one host read by design and is run
outside the audited region. A first pass in "warn" mode lists every sync by region; the second pass in "error" mode
is the verdict. Rank 0 prints a summary and writes `--out` (JSON) when given; the exit code is 1 when a sync was
found. Without CUDA it prints a message and exits 0; `--cpu-dry-run` runs the same loop on gloo/CPU without the
sync check (to test this script on a machine without a GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_worker import LOSS_KEYS, METRIC_SPECS, build_model, record_micro_batch, sync_gradients
from harness import MicroBatch, make_steps, vlm_dataset

from veomni_lite.distributed.parallel_state import destroy_parallel_state, init_parallel_state
from veomni_lite.metrics import MetricAccumulator
from veomni_lite.utils.loss_utils import count_loss_token, mean_global_loss, reset_loss_memo, verify_loss_keys

REGIONS = ("count", "forward", "loss", "backward", "metrics")


class SyncAudit:
    """Runs blocks under a sync-debug mode and files the sync warnings they raise under a region name."""

    def __init__(self, mode: str | None) -> None:
        self.mode = mode  # None: no audit (CPU dry run)
        self.syncs: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        if self.mode is None:
            yield
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(self.mode)
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(0)
        for warning in caught:
            if "synchroniz" in str(warning.message):
                self.syncs[name] += 1
                self.sites[f"{name}: {Path(warning.filename).name}:{warning.lineno}"] += 1


def micro_batch_loop(
    model: torch.nn.Module, micro_batches: list[MicroBatch], metrics: MetricAccumulator, audit: SyncAudit, sp: int
) -> None:
    """The audited part of a train step: everything per micro-batch, as `BaseTrainer.train_step` does it."""
    flops_per_token = model.flops_per_token(micro_batches[0]["input_ids"].shape[1] * sp)
    with audit.region("count"):
        step_tokens = count_loss_token(micro_batches)
    for micro_batch in micro_batches:
        with audit.region("count"):
            micro_tokens = count_loss_token(micro_batch)
        with audit.region("forward"):
            outputs = model(**micro_batch)
        with audit.region("loss"):
            losses = {key: outputs[key] for key in LOSS_KEYS}
            loss = sum(mean_global_loss(losses, micro_tokens, step_tokens).values())
        with audit.region("backward"):
            loss.backward()
        with audit.region("metrics"):
            record_micro_batch(metrics, losses, micro_batch, flops_per_token)


def step_end(model: torch.nn.Module, optimizer: torch.optim.Optimizer, metrics: MetricAccumulator) -> None:
    """Outside the audit: the step's gradient all-reduce, key check (the one host read), update and log."""
    sync_gradients(list(model.parameters()), dist.get_world_size())
    verify_loss_keys()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    metrics.reduce()


def run(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % args.sp:
        raise SystemExit(f"--sp {args.sp} does not divide the world size {world}")
    state = init_parallel_state(world // args.sp, args.sp)
    dataset = vlm_dataset()
    model = build_model(dataset.vocab_size, dataset.num_image_codes, dataset.image_token_id, args.sp, state.sp_group)
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    metrics = MetricAccumulator(METRIC_SPECS, sp_rank=state.sp_rank)
    host_steps = make_steps(dataset, 2, args.ga, state.dp_size, state.dp_rank, args.sp, state.sp_rank, 2)
    steps = [[{k: v.to(device) for k, v in mb.items()} for mb in step] for step in host_steps]
    if device.type == "cuda":
        torch.cuda.synchronize(device)

    warm = SyncAudit(None)
    micro_batch_loop(model, steps[0], metrics, warm, args.sp)  # NCCL communicators, kernels, AdamW state: not audited
    step_end(model, optimizer, metrics)

    audit_mode = "warn" if device.type == "cuda" else None
    warn = SyncAudit(audit_mode)
    for index in range(args.steps):
        micro_batch_loop(model, steps[index % len(steps)], metrics, warn, args.sp)
        step_end(model, optimizer, metrics)

    error_text = ""
    error = SyncAudit("error" if device.type == "cuda" else None)
    try:
        for index in range(args.steps):
            micro_batch_loop(model, steps[index % len(steps)], metrics, error, args.sp)
            step_end(model, optimizer, metrics)
        passed = True
    except RuntimeError as exc:  # a sync raised: report where (other ranks may then hang on a collective)
        passed = False
        error_text = "".join(traceback.format_exception(exc)[-6:])
    reset_loss_memo()
    destroy_parallel_state()
    return {
        "rank": rank,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run: no sync check)",
        "world": world,
        "sp": args.sp,
        "grad_accum": args.ga,
        "steps": args.steps,
        "torch": torch.__version__,
        "backend": dist.get_backend(),
        "audited": device.type == "cuda",
        "warn_syncs_by_region": dict(warn.syncs),
        "warn_sync_sites": dict(warn.sites),
        "error_mode_passed": passed and sum(warn.syncs.values()) == 0,
        "error": error_text,
        "generated": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sp", type=int, default=1, help="sequence-parallel size (divides the world size)")
    parser.add_argument("--ga", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=3, help="audited steps per pass")
    parser.add_argument("--out", type=Path, default=None, help="JSON rank 0 writes (docs/benchmarks_gpu*.json)")
    parser.add_argument("--cpu-dry-run", action="store_true", help="run the loop on gloo/CPU without the sync check")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print("gpu_sync_audit: CUDA is not available here; this audit needs a CUDA machine with NCCL (see --help).")
        return 0
    if "RANK" not in os.environ:
        print("gpu_sync_audit: launch it with torchrun, e.g. torchrun --standalone --nproc_per_node 2 " + sys.argv[0])
        return 2
    if args.cpu_dry_run:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        device = torch.device("cpu")
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120), device_id=device)
    # Results travel over a CPU group: NCCL work a failed rank left pending cannot block the report.
    report_group = dist.new_group(backend="gloo")
    result = run(args, device)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result, group=report_group)
    failed = not all(r["error_mode_passed"] for r in gathered)
    if dist.get_rank() == 0:
        summary = {
            **{k: v for k, v in gathered[0].items() if k != "rank"},
            "ranks": len(gathered),
            "warn_syncs_by_region": dict(sum((Counter(r["warn_syncs_by_region"]) for r in gathered), Counter())),
            "warn_sync_sites": dict(sum((Counter(r["warn_sync_sites"]) for r in gathered), Counter())),
            "error_mode_passed": not failed,
            "error": "\n".join(f"rank {r['rank']}: {r['error']}" for r in gathered if r["error"]),
        }
        print(json.dumps(summary, indent=1))
        if not summary["audited"]:
            print("gpu_sync_audit: CPU dry run: the loop ran on every rank; nothing was audited (no CUDA).")
        elif failed:
            print("gpu_sync_audit: FAIL: the micro-batch loop synchronizes the host (see warn_sync_sites, error).")
        else:
            print("gpu_sync_audit: PASS: zero host syncs in the micro-batch loop.")
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(summary, indent=1) + "\n")
    if not failed:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
