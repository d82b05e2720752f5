"""GPU audit: veomni_lite's micro-batch loop under `torch.cuda.set_sync_debug_mode("error")`, with NCCL and bf16.

Run on a CUDA machine, one process per GPU (SP must divide the world size and the 4 attention heads); `make test-gpu`
runs it through tests/gpu/test_gpu.py:
    torchrun --standalone --nproc_per_node 2 benchmarks/gpu_sync_audit.py --sp 1
    torchrun --standalone --nproc_per_node 2 benchmarks/gpu_sync_audit.py --sp 2
The model is the tiny VLM of configs/vlm_tiny.yaml under FSDP2 with the trainer's mixed precision ("auto": the bf16
`MixedPrecisionPolicy` on CUDA), gradient sync on the last micro-batch only, as `BaseTrainer.train_step` runs it.
What it checks: per micro-batch `count_loss_token`, forward (Ulysses all-to-alls under SP), `mean_global_loss`,
backward and the trainer's per-micro-batch metric records (`MetricAccumulator.record`), with the step's
`count_loss_token` before them, must not synchronize the host with the device. The step end (the grad-norm
all-reduce and clip, `verify_loss_keys`, the step's one host read, AdamW, the log-time metric reduce) has its one
host read by design and runs outside the audited region. A first pass in "warn" mode lists every sync by region; the
second pass in "error" mode is the verdict. Then the step (loop and step end, synchronized) is timed with no loss
normalization (local means / GA, no collective), the oracle's (one all-reduce of the step's counts) and
veomni_lite's, interleaved. Rank 0 prints a summary and writes `--out` (JSON, by default under
benchmarks/results/gpu/, where `make bench` picks it up); the exit code is 1 when a sync was found. Without CUDA it
prints a message and exits 0; `--cpu-dry-run` runs the same code on gloo/CPU in fp32 without the sync check (so the
script is tested on machines without a GPU).
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
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# The example models and data live in the repository's top-level examples/ (not part of the installed library);
# run as a script, this file's folder comes first on sys.path, so put the repository root there too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from baselines import Oracle
from bench_worker import LOSS_KEYS, METRIC_SPECS, build_model, record_micro_batch
from harness import MicroBatch, make_steps, summarize, vlm_dataset

from veomni_lite.distributed.fsdp import apply_fsdp, resolve_mixed_precision, set_gradient_sync
from veomni_lite.distributed.grad_norm import clip_global_grad_norm
from veomni_lite.distributed.parallel_state import destroy_parallel_state, get_parallel_state, init_parallel_state
from veomni_lite.metrics import MetricAccumulator
from veomni_lite.utils.loss_utils import count_loss_token, mean_global_loss, reset_loss_memo, verify_loss_keys

REGIONS = ("count", "forward", "loss", "backward", "metrics")
MODES = ("none", "oracle", "veomni_lite")  # the loss normalizations the step is timed with
RESULTS = Path(__file__).resolve().parent / "results" / "gpu"
MAX_GRAD_NORM = 1.0  # configs/vlm_tiny.yaml


class SyncAudit:
    """Runs blocks under a sync-debug mode and files the sync warnings they raise under a region name."""

    def __init__(self, mode: str | None) -> None:
        self.mode = mode  # None: no audit (CPU dry run, timing)
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


def normalizer(mode: str, grad_accum: int) -> Callable[[dict[str, torch.Tensor], Any, Any], dict[str, torch.Tensor]]:
    """`(losses, micro tokens, step tokens) -> scaled losses` for one step in `mode` (a fresh oracle per step)."""
    if mode == "veomni_lite":
        return mean_global_loss
    if mode == "none":
        return lambda losses, micro, step: {key: loss / grad_accum for key, loss in losses.items()}
    oracle, started = Oracle(), []

    def scale(losses: dict[str, torch.Tensor], micro: Any, step: Any) -> dict[str, torch.Tensor]:
        if not started:
            oracle.start_step(step, grad_accum)
            started.append(True)
        return oracle.scale(losses, micro, step)

    return scale


def micro_batch_loop(
    model: torch.nn.Module,
    micro_batches: list[MicroBatch],
    metrics: MetricAccumulator,
    audit: SyncAudit,
    flops_per_token: float,
    mode: str = "veomni_lite",
) -> torch.Tensor:
    """The audited part of a train step, as `BaseTrainer.train_step` runs it; returns this rank's step loss."""
    scale = normalizer(mode, len(micro_batches))
    with audit.region("count"):
        step_tokens = count_loss_token(micro_batches)
    step_loss = torch.zeros((), device=micro_batches[0]["labels"].device)
    last = len(micro_batches) - 1
    for index, micro_batch in enumerate(micro_batches):
        with audit.region("count"):
            micro_tokens = count_loss_token(micro_batch)
        with audit.region("forward"):
            set_gradient_sync(model, index == last)
            outputs = model(**micro_batch)
        with audit.region("loss"):
            losses = {key: outputs[key] for key in LOSS_KEYS}
            loss = sum(scale(losses, micro_tokens, step_tokens).values())
        with audit.region("backward"):
            loss.backward()
        with audit.region("metrics"):
            step_loss = step_loss + loss.detach()
            record_micro_batch(metrics, losses, micro_batch, flops_per_token)
    return step_loss


def step_end(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, metrics: MetricAccumulator, step_loss: torch.Tensor
) -> None:
    """Outside the audit, as the trainer ends a step: grad-norm all-reduce + clip, key verdict, the one host read,
    AdamW, then the log-time metric reduce."""
    params = list(model.parameters())
    norm, bad = clip_global_grad_norm(params, MAX_GRAD_NORM, step_loss, get_parallel_state().world_group)
    verify_loss_keys()
    torch.stack([norm.double(), bad]).cpu().tolist()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    metrics.reduce()


def timed_steps(
    run: Callable[[str, int], None], reps: int, device: torch.device, group: dist.ProcessGroup
) -> dict[str, list[float]]:
    """Every mode once per repetition, rotated; each step synchronized and timed; the slowest rank's time."""
    local: dict[str, list[float]] = {mode: [] for mode in MODES}
    for rep in range(reps):
        shift = rep % len(MODES)
        for mode in MODES[shift:] + MODES[:shift]:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier(group=group)
            start = time.perf_counter()
            run(mode, rep)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            local[mode].append(time.perf_counter() - start)
    out = {}
    for mode, values in local.items():
        buffer = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=group)
        out[mode] = buffer.tolist()
    return out


def paired_ratio(num: list[float], den: list[float]) -> list[float]:
    """[median, q1, q3] of num / den per repetition."""
    ratios = sorted(n / d for n, d in zip(num, den) if d > 0)
    if len(ratios) < 2:
        return [ratios[0]] * 3 if ratios else [float("nan")] * 3
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return [median, q1, q3]


def run(args: argparse.Namespace, device: torch.device, report_group: dist.ProcessGroup) -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % args.sp:
        raise SystemExit(f"--sp {args.sp} does not divide the world size {world}")
    state = init_parallel_state(world // args.sp, args.sp)
    dataset = vlm_dataset()
    model = build_model(dataset.vocab_size, dataset.num_image_codes, dataset.image_token_id, args.sp, state.sp_group)
    bf16 = resolve_mixed_precision("auto", device)
    model = apply_fsdp(model.to(device), state, list(model.layers), bf16=bf16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    metrics = MetricAccumulator(METRIC_SPECS, sp_rank=state.sp_rank)
    host_steps = make_steps(dataset, 2, args.ga, state.dp_size, state.dp_rank, args.sp, state.sp_rank, 2)
    steps = [[{k: v.to(device) for k, v in mb.items()} for mb in step] for step in host_steps]
    flops_per_token = model.flops_per_token(host_steps[0][0]["input_ids"].shape[1] * args.sp)
    if device.type == "cuda":
        torch.cuda.synchronize(device)

    def one_step(audit: SyncAudit, index: int, mode: str = "veomni_lite") -> None:
        step_loss = micro_batch_loop(model, steps[index % len(steps)], metrics, audit, flops_per_token, mode)
        step_end(model, optimizer, metrics, step_loss)

    for mode in MODES:  # NCCL communicators, kernels, AdamW state, every mode's path: not audited
        one_step(SyncAudit(None), 0, mode)

    audit_mode = "warn" if device.type == "cuda" else None
    warn = SyncAudit(audit_mode)
    for index in range(args.steps):
        one_step(warn, index)

    error_text = ""
    error = SyncAudit("error" if device.type == "cuda" else None)
    try:
        for index in range(args.steps):
            one_step(error, index)
        passed = True
    except RuntimeError as exc:  # a sync raised: report where (other ranks may then hang on a collective)
        passed = False
        error_text = "".join(traceback.format_exception(exc)[-6:])

    times: dict[str, list[float]] = {}
    if passed and args.time_reps:
        timing = SyncAudit(None)
        times = timed_steps(lambda mode, rep: one_step(timing, rep, mode), args.time_reps, device, report_group)
    reset_loss_memo()
    destroy_parallel_state()
    return {
        "rank": rank,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run: no sync check)",
        "world": world,
        "sp": args.sp,
        "grad_accum": args.ga,
        "micro_batch_size": 2,
        "steps": args.steps,
        "precision": "bf16" if bf16 else "fp32",
        "torch": torch.__version__,
        "backend": dist.get_backend(),
        "audited": device.type == "cuda",
        "warn_syncs_by_region": dict(warn.syncs),
        "warn_sync_sites": dict(warn.sites),
        "error_mode_passed": passed and sum(warn.syncs.values()) == 0,
        "error": error_text,
        "time_reps": len(times.get(MODES[0], [])),
        "step_times_s": times,
        "step_time_s": {mode: summarize(values) for mode, values in times.items() if values},
        "normalization_ratio": paired_ratio(times["veomni_lite"], times["none"]) if times else None,
        "oracle_ratio": paired_ratio(times["veomni_lite"], times["oracle"]) if times else None,
        "generated": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sp", type=int, default=1, help="sequence-parallel size (divides the world size)")
    parser.add_argument("--ga", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=3, help="audited steps per pass")
    parser.add_argument("--time-reps", type=int, default=20, help="timed repetitions per normalization (0: none)")
    parser.add_argument("--out", type=Path, default=None, help="JSON rank 0 writes (default: benchmarks/results/gpu/)")
    parser.add_argument("--cpu-dry-run", action="store_true", help="run on gloo/CPU in fp32 without the sync check")
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
    # Barriers, timings and results travel over a CPU group: NCCL work a failed rank left pending cannot block them.
    report_group = dist.new_group(backend="gloo")
    result = run(args, device, report_group)
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
        print(json.dumps({k: v for k, v in summary.items() if k != "step_times_s"}, indent=1))
        if not summary["audited"]:
            print("gpu_sync_audit: CPU dry run: the loop ran on every rank; nothing was audited (no CUDA).")
        elif failed:
            print("gpu_sync_audit: FAIL: the micro-batch loop synchronizes the host (see warn_sync_sites, error).")
        else:
            print("gpu_sync_audit: PASS: zero host syncs in the micro-batch loop.")
        out = args.out
        if out is None:
            kind = "cpu_dry_run" if args.cpu_dry_run else "gpu"
            out = RESULTS / f"{kind}_sync_audit_world{summary['world']}_sp{args.sp}.json"
        if summary["audited"] or args.out is not None:  # a dry run writes only where it is told to
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(summary, indent=1) + "\n")
    if not failed:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
