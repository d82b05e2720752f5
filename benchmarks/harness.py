"""Shared bench machinery: counting collectives and host reads, interleaved timing, the tiny VLM's data, the
arithmetic demo's data with a Qwen2 of a given size, model bytes, peak RSS.

- `OpCounter.active()` patches the `torch.distributed` collectives and the `torch.Tensor` host-read methods and counts
  every call; only the untimed counting round runs under it, so timed steps run unpatched.
- `interleaved_times` runs every strategy once per repetition in a rotated order, each call after an untimed barrier,
  and returns per strategy the max over ranks of each call's seconds (a step is as slow as its slowest rank).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from examples.synthetic_data import SyntheticVLMDataset
from veomni_lite.data.collator import collate
from veomni_lite.data.loader import MicroBatchLoader
from veomni_lite.distributed.sequence_parallel import slice_micro_batch

MicroBatch = dict[str, torch.Tensor]
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all_single")
COLLECTIVES += ("broadcast", "reduce_scatter_tensor", "reduce_scatter_single")
HOST_READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__")


class OpCounter:
    """Counts collectives and host reads made inside `active()` (one per process, not thread-safe)."""

    def __init__(self) -> None:
        self.collectives: Counter[str] = Counter()
        self.host_reads: Counter[str] = Counter()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        saved_dist = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
        saved_tensor = {name: getattr(torch.Tensor, name) for name in HOST_READS}
        own = {name for name in HOST_READS if name in vars(torch.Tensor)}  # the rest are inherited C methods
        for name, original in saved_dist.items():
            setattr(dist, name, self._wrap(self.collectives, name, original))
        for name, original in saved_tensor.items():
            setattr(torch.Tensor, name, self._wrap(self.host_reads, name, original))
        try:
            yield
        finally:
            for name, original in saved_dist.items():
                setattr(dist, name, original)
            for name, original in saved_tensor.items():
                if name in own:
                    setattr(torch.Tensor, name, original)
                else:
                    delattr(torch.Tensor, name)

    @staticmethod
    def _wrap(counter: Counter[str], name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            counter[name] += 1
            return original(*args, **kwargs)

        return counted

    def count(self, run: Callable[[], Any]) -> dict[str, int]:
        """Run `run()` under the counter; {"collectives": n, "host_reads": n} of that call alone."""
        self.collectives.clear()
        self.host_reads.clear()
        with self.active():
            run()
        return {"collectives": sum(self.collectives.values()), "host_reads": sum(self.host_reads.values())}


def summarize(seconds: Sequence[float]) -> dict[str, float]:
    """Median, quartiles (inclusive method), min and max of `seconds`."""
    values = sorted(seconds)
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"median": statistics.median(values), "q1": q1, "q3": q3, "min": values[0], "max": values[-1]}


def interleaved_times(steps: Mapping[str, Callable[[int], Any]], reps: int, offset: int = 0) -> dict[str, list[float]]:
    """`steps[name](rep)` for every name, `reps` times, the order rotated each repetition (see the module doc)."""
    names = list(steps)
    local: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        shift = (rep + offset) % len(names)
        for name in names[shift:] + names[:shift]:
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            steps[name](rep)
            local[name].append(time.perf_counter() - start)
    return {name: max_over_ranks(values) for name, values in local.items()}


def timed_reps(steps: Mapping[str, Callable[[int], Any]], budget_s: float, min_reps: int, max_reps: int) -> dict:
    """One warm-up repetition sizes the count (the same on every rank), then the timed interleaved repetitions."""
    warm = sum(values[0] for values in interleaved_times(steps, 1).values())
    reps = max(min_reps, min(max_reps, int(budget_s / max(warm, 1e-9))))
    return interleaved_times(steps, reps, offset=1)


def max_over_ranks(values: list[float]) -> list[float]:
    """Element-wise max of `values` over the ranks (one float64 MAX all-reduce, outside any timed region)."""
    if not dist.is_initialized() or not values:
        return list(values)
    buffer = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(buffer, op=dist.ReduceOp.MAX)
    return buffer.tolist()


def vlm_dataset(num_samples: int = 1024, seed: int = 0) -> SyntheticVLMDataset:
    return SyntheticVLMDataset(num_samples=num_samples, image_size=16, patch_size=4, seed=seed)


def make_steps(
    dataset: SyntheticVLMDataset,
    micro_batch_size: int,
    grad_accum: int,
    dp_size: int,
    dp_rank: int,
    sp_size: int,
    sp_rank: int,
    num_steps: int,
) -> list[list[MicroBatch]]:
    """`num_steps` optimizer steps of this rank's micro-batches (collated, shifted once, SP-sliced), precomputed."""
    loader = MicroBatchLoader(
        dataset, collate, micro_batch_size * dp_size * grad_accum, micro_batch_size, dp_size=dp_size, dp_rank=dp_rank
    )
    return [[slice_micro_batch(mb, sp_rank, sp_size) for mb in loader.next_step()] for _ in range(num_steps)]


def math_model(work_dir: Path, model: dict[str, int]) -> Path:
    """The arithmetic demo's files (`examples.rl_math`: 512 RL prompts, under `work_dir/data`) and a Qwen2 directory
    of `model`'s size with their tokenizer, randomly initialized (both kept where they exist)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from examples.rl_math import write_demo

    data = write_demo(work_dir / "data", sft_rows=16, rl_rows=512, eval_rows=16)
    directory = work_dir / f"qwen2_{model['hidden_size']}x{model['num_hidden_layers']}"
    if not (directory / "config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(data / "models/qwen2_math"))
        config = Qwen2Config(vocab_size=len(tokenizer), num_key_value_heads=4, max_position_embeddings=512, **model)
        config.eos_token_id, config.pad_token_id, config.tie_word_embeddings = tokenizer.eos_token_id, 0, False
        AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (directory / name).write_bytes((data / "models/qwen2_math" / name).read_bytes())
    return directory


def model_bytes(model: torch.nn.Module) -> int:
    """The whole model's parameter bytes (a sharded DTensor counts whole), frozen ones included."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def reset_peak_rss() -> None:
    """Start this process's peak RSS (`VmHWM`) afresh."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss_mib() -> float:
    """This process's peak RSS since start or the last `reset_peak_rss()`, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def torchrun(script: Path, nproc: int, args: list[str], timeout_s: float, env: dict[str, str] | None = None) -> str:
    """Run `script` under `torchrun --standalone` on `nproc` processes (OMP_NUM_THREADS=1); its output, or a
    RuntimeError with the output's tail when it fails or runs past `timeout_s`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    return run_script(command, script, args, timeout_s, env)


def run_script(
    launcher: list[str], script: Path, args: list[str], timeout_s: float, env: dict[str, str] | None = None
) -> str:
    """`launcher script args` (one process: `[sys.executable]`) with OMP_NUM_THREADS=1, as `torchrun` runs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    done = subprocess.run([*launcher, str(script), *args], env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode:
        failed = f"{script.name} {' '.join(args)} exited {done.returncode}"
        raise RuntimeError(f"{failed}:\n{done.stdout[-2000:]}{_cause(done)}")
    return done.stdout


def _cause(done: subprocess.CompletedProcess) -> str:
    """A failed torchrun's stderr cut to what names the cause: its first traceback (a rank's: the launcher's own
    comes last and would fill the tail), then the tail."""
    first = done.stderr.find("Traceback (most recent call last)")
    if first < 0 or first >= len(done.stderr) - 2000:
        return done.stderr[-2000:]
    return f"{done.stderr[first : first + 3000]}\n[...]\n{done.stderr[-2000:]}"


def prose(doc: str) -> str:
    """A module docstring as page text: its paragraphs unwrapped, without the leading 'make bench: '."""
    text = "\n\n".join(" ".join(part.split()) for part in doc.removeprefix("make bench: ").split("\n\n"))
    return text[:1].upper() + text[1:]


def local_bytes(tensor: torch.Tensor) -> int:
    """The bytes this rank holds of `tensor` (a DTensor's local shard)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def rank_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, experts: set[int]) -> dict[str, dict]:
    """This rank's bytes of parameters, gradients (where set) and optimizer state, {"experts": {...}, "other":
    {...}}, each {"parameters", "gradients", "optimizer"}: the parameters whose id is in `experts` apart."""
    out = {part: dict.fromkeys(("parameters", "gradients", "optimizer"), 0) for part in ("experts", "other")}
    for param in model.parameters():
        part = out["experts" if id(param) in experts else "other"]
        part["parameters"] += local_bytes(param)
        part["gradients"] += local_bytes(param.grad) if param.grad is not None else 0
        state = optimizer.state.get(param, {})
        part["optimizer"] += sum(local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return out


@contextlib.contextmanager
def gathered_bytes(modules: Sequence[torch.nn.Module]) -> Iterator[list[int]]:
    """The bytes of each of `modules`' own parameters as its forwards see them (FSDP2 gathers them there), the
    largest over the forwards run inside, in the order of `modules`."""
    seen = [0] * len(modules)

    def hook(index: int) -> Callable[..., None]:
        def record(module: torch.nn.Module, _args: Any) -> None:
            size = sum(local_bytes(p) for p in module.parameters(recurse=False))
            seen[index] = max(seen[index], size)

        return record

    handles = [m.register_forward_pre_hook(hook(i)) for i, m in enumerate(modules)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def collective_seconds(step: Callable[[], Any]) -> tuple[float, dict[str, float]]:
    """(the wall seconds of `step()`, run under torch's profiler; per collective kind ("all_gather", "all_to_all",
    "reduce_scatter", "all_reduce", ...): the seconds during which at least one such collective of the backend
    (gloo's or NCCL's profiler events) was in flight, the union of their intervals)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
    spans: dict[str, list[tuple[float, float]]] = {}
    for event in prof.events():
        backend, _, kind = event.name.partition(":")
        if backend in ("gloo", "nccl") and kind:
            kind = kind.removesuffix("_base").removesuffix("_into_tensor").removesuffix("_coalesced")
            spans.setdefault(kind, []).append((event.time_range.start, event.time_range.end))
    busy = {}
    for kind, intervals in spans.items():
        total, end = 0.0, float("-inf")
        for lo, hi in sorted(intervals):
            total += max(0.0, hi - max(lo, end))
            end = max(end, hi)
        busy[kind] = total / 1e6  # the profiler's microseconds
    return wall, busy
