"""Run a function on N real gloo processes, collecting each rank's return value or traceback.

The processes are forked from multiprocessing's forkserver, which imports torch, transformers and the trainer once
per test session (a fresh spawn pays about 6 s of imports per process on these machines). The server is a clean
process that runs no torch work itself, so forking from it is safe; each rank still gets its own process group.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import queue
import tempfile
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.multiprocessing as mp


def _worker(
    rank: int,
    world_size: int,
    init_file: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    timeout_s: float,
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            # Serialized by value: a tensor shared by file descriptor would vanish when this process exits.
            buffer = io.BytesIO()
            torch.save(fn(rank, world_size, *args), buffer)
            results.put((rank, "ok", buffer.getvalue()))
        finally:
            from veomni_lite.distributed.parallel_state import destroy_parallel_state

            destroy_parallel_state()
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports every rank's failure
        results.put((rank, "error", traceback.format_exc()))


# What the forkserver imports once: the heavy modules every rank would otherwise import again.
PRELOAD = [
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen2_vl.modeling_qwen2_vl",
    "veomni_lite.trainer.base",
    "tests.trainer.helpers",
]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


@contextlib.contextmanager
def counting_calls(owner: Any, name: str) -> Iterator[list[int]]:
    """Patch `owner.name` with a wrapper that appends 1 to the yielded list per call; restore on exit."""
    calls: list[int] = []
    original = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    setattr(owner, name, counted)
    try:
        yield calls
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def counting_world_all_reduces() -> Iterator[list[int]]:
    """Patch `dist.all_reduce` to append 1 to the yielded list per call over the whole world (the loss's all-reduce;
    an SP group's are not counted); restore on exit."""
    import torch.distributed as dist

    calls: list[int] = []
    original = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group", args[2] if len(args) > 2 else None)
        if group is None or group is dist.group.WORLD:
            calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counted
    try:
        yield calls
    finally:
        dist.all_reduce = original


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0, pg_timeout_s: float = 60.0
) -> dict[int, tuple[str, Any]]:
    """Call `fn(rank, world_size, *args)` on `world_size` gloo ranks; return {rank: ("ok"|"error", value)}.

    An "error" value is the rank's traceback text. Raises RuntimeError when a rank does not finish within `timeout_s`.
    """
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg_init")
        procs = [
            ctx.Process(target=_worker, args=(rank, world_size, init_file, fn, args, results, pg_timeout_s))
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        outcomes: dict[int, tuple[str, Any]] = {}
        try:
            while len(outcomes) < world_size:
                rank, status, value = results.get(timeout=timeout_s)
                if status == "ok":
                    value = torch.load(io.BytesIO(value), weights_only=False)
                outcomes[rank] = (status, value)
        except queue.Empty:
            missing = sorted(set(range(world_size)) - set(outcomes))
            raise RuntimeError(f"ranks {missing} did not finish within {timeout_s}s; got {outcomes}") from None
        finally:
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
    return outcomes


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """`run_ranks`, raising RuntimeError with every failing rank's traceback; results ordered by rank."""
    outcomes = run_ranks(fn, world_size, *args, **kwargs)
    errors = {rank: value for rank, (status, value) in outcomes.items() if status == "error"}
    if errors:
        raise RuntimeError("\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(errors.items())))
    return [outcomes[rank][1] for rank in range(world_size)]
