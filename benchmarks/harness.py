"""Shared benchmark machinery: counting collectives and host reads, interleaved timing, data, machine facts.

Contract:
- `OpCounter` patches `torch.distributed` collectives and the `torch.Tensor` host-read methods while it is
  `active()`, and files every call under the current `phase(...)` name, with the elements each collective sends
  from this rank. `all_to_all_single` is always filed under "model" (the Ulysses attention all-to-all), whatever
  the phase. Counting is only switched on for the untimed
  counting round: timed steps run unpatched, so the counter costs them nothing.
- `interleaved_times` runs every strategy once per repetition in a rotated order, each step preceded by an untimed
  barrier, and returns per-strategy step times (the max over ranks of each step), optionally CPU times too.
- `summarize` gives median, quartiles, min and max of a list of seconds.
"""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from examples.synthetic_data import SyntheticVLMDataset
from veomni_lite.data.collator import collate
from veomni_lite.data.loader import MicroBatchLoader
from veomni_lite.distributed.sequence_parallel import slice_micro_batch

MicroBatch = dict[str, torch.Tensor]

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "all_to_all_single",
    "broadcast",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
)
HOST_READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__")
MODEL_COLLECTIVES = ("all_to_all_single",)
# collectives whose positional argument 1 (not 0) is the tensor this rank sends
SEND_ARG_1 = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_to_all_single",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
)


class OpCounter:
    """Counts collectives and host reads by phase (see the module docstring). Not thread-safe; one per process."""

    def __init__(self) -> None:
        self.collectives: Counter[tuple[str, str]] = Counter()  # (phase, op) -> calls
        self.host_reads: Counter[tuple[str, str]] = Counter()
        self.elements: Counter[tuple[str, str]] = Counter()  # (phase, op) -> elements sent by this rank
        self._phase = "step"
        self._active = False

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """File calls made inside the block under `name` (nests; restores the outer phase)."""
        outer, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = outer

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Patch the collectives and host-read methods for the duration of the block."""
        saved_dist = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
        saved_tensor = {name: getattr(torch.Tensor, name) for name in HOST_READS}
        own = {name for name in HOST_READS if name in vars(torch.Tensor)}  # the rest are inherited C methods
        for name, original in saved_dist.items():
            setattr(dist, name, self._wrap_collective(name, original))
        for name, original in saved_tensor.items():
            setattr(torch.Tensor, name, self._wrap_read(name, original))
        self._active = True
        try:
            yield
        finally:
            self._active = False
            for name, original in saved_dist.items():
                setattr(dist, name, original)
            for name, original in saved_tensor.items():
                if name in own:
                    setattr(torch.Tensor, name, original)
                else:
                    delattr(torch.Tensor, name)

    def _wrap_collective(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            phase = "model" if name in MODEL_COLLECTIVES else self._phase
            self.collectives[(phase, name)] += 1
            sent = args[1] if name in SEND_ARG_1 and len(args) > 1 else args[0] if args else None
            self.elements[(phase, name)] += sent.numel() if isinstance(sent, torch.Tensor) else 0
            return original(*args, **kwargs)

        return counted

    def _wrap_read(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.host_reads[(self._phase, name)] += 1
            return original(tensor, *args, **kwargs)

        return counted

    def reset(self) -> None:
        self.collectives.clear()
        self.host_reads.clear()
        self.elements.clear()

    def snapshot(self, steps: int) -> dict[str, Any]:
        """Per-step counts over `steps`: {"collectives" | "host_reads" | "elements": {phase: n}, "*_by_op": {...}}."""

        def per_phase(counter: Counter[tuple[str, str]]) -> dict[str, float]:
            out: dict[str, float] = {}
            for (phase, _op), calls in counter.items():
                out[phase] = out.get(phase, 0.0) + calls / steps
            return out

        def by_op(counter: Counter[tuple[str, str]]) -> dict[str, float]:
            return {f"{phase}/{op}": calls / steps for (phase, op), calls in sorted(counter.items())}

        return {
            "collectives": per_phase(self.collectives),
            "host_reads": per_phase(self.host_reads),
            "elements": per_phase(self.elements),
            "collectives_by_op": by_op(self.collectives),
            "host_reads_by_op": by_op(self.host_reads),
        }


def maybe(counter: OpCounter | None, name: str) -> contextlib.AbstractContextManager[None]:
    """`counter.phase(name)`, or a no-op context when there is no counter."""
    return counter.phase(name) if counter is not None else contextlib.nullcontext()


def summarize(seconds: Sequence[float]) -> dict[str, float]:
    """Median, quartiles (inclusive method), min and max of `seconds`, all in seconds."""
    values = sorted(seconds)
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": statistics.median(values), "q1": q1, "q3": q3, "min": values[0], "max": values[-1]}


def interleaved_times(
    steps: Mapping[str, Callable[[int], None]],
    reps: int,
    rotate_offset: int = 0,
    cpu_times: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Run `steps[name](rep)` for every name, `reps` times, rotating the order each repetition.

    Each call is preceded by an untimed barrier so all ranks start together; returns, per name, the max over ranks
    of each call's wall time in seconds. Every rank must pass the same names and `reps`. With `cpu_times`, it also
    fills in, per name, the max over ranks of each call's process CPU time (all threads; time spent waiting or
    descheduled does not count, so it is less sensitive to other load on the machine).
    """
    names = list(steps)
    local: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        shift = (rep + rotate_offset) % len(names)
        for name in names[shift:] + names[:shift]:
            barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            steps[name](rep)
            local[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    if cpu_times is not None:
        cpu_times.update({name: max_over_ranks(values) for name, values in cpu.items()})
    return {name: max_over_ranks(values) for name, values in local.items()}


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def max_over_ranks(values: list[float]) -> list[float]:
    """Element-wise max of `values` over all ranks (one float64 MAX all-reduce, outside any timed region)."""
    if not dist.is_initialized() or not values:
        return list(values)
    buffer = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(buffer, op=dist.ReduceOp.MAX)
    return buffer.tolist()


def agree_max(value: float) -> float:
    """The max of `value` over ranks, so every rank takes the same decision (e.g. a repetition count)."""
    return max_over_ranks([value])[0]


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


def rss_kib() -> int:
    """Current resident set size (VmRSS) in KiB; 0 where /proc is unavailable."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def peak_rss_kib() -> int:
    """Peak resident set size of this process in KiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak


def machine_description() -> dict[str, Any]:
    """CPU model, core count, memory, OS, Python, torch and thread settings: what the numbers were measured on."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = 0.0
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemTotal:"):
                    mem_gib = int(line.split()[1]) / 2**20
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "memory_gib": round(mem_gib, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backend": "gloo",
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
        "torch_threads": torch.get_num_threads(),
    }
