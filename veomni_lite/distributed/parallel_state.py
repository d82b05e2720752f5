"""The data-parallel x sequence-parallel layout of a run.

`init_parallel_state(dp_size, sp_size, timeout_s=...)` builds a 2-D DeviceMesh with dims ("dp", "sp"): rank =
dp_rank * sp_size + sp_rank, so each sp group is a block of consecutive ranks. `get_parallel_state()` returns it, or a
single-process state (dp = sp = 1, no groups) when nothing was initialized, so every caller works unchanged without
torchrun. It also answers VeOmni's names (`fsdp_size`, `sp_enabled`, `sp_size`, `sp_group`) so VeOmni callers
read it unchanged.

HSDP: with `dp_replicate` R > 1, FSDP2 gets a 2-D mesh ("replicate", "shard") over the same ranks: parameters are
sharded within each block of world / R consecutive ranks (a node, when that is the processes per node) and replicated
across the R blocks. R must divide dp_size, so every sp group stays inside one shard block. Gradients are still
averaged over all dp x sp ranks (reduce-scatter within a block, all-reduce across blocks), so the loss
normalization's W is the world size under HSDP too.

Expert parallelism: with `ep_size` > 1, a second 2-D mesh ("efsdp", "ep") over the same world: rank =
efsdp_rank * ep_size + ep_rank, so each ep group is a block of ep_size consecutive ranks (within a node, where the
all-to-all is cheapest). The routed experts are split over "ep" (`veomni_lite.distributed.expert_parallel`) and
FSDP2 shards each rank's experts further over "efsdp" (the world / ep_size ranks that hold the same experts). Under
HSDP the mesh is 3-D, ("replicate", "efsdp", "ep"): ep groups inside each shard block, the experts sharded over
"efsdp" within it and replicated across the blocks like every other parameter.

Timeouts: every process group the project creates (the mesh's dp and sp groups, and any group made with
`ParallelState.new_group`, e.g. the trainer's control group and the metrics group) uses the state's `timeout_s`, so a
collective that one rank never joins fails within it (torch's own default for a new group is 30 minutes).
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

DEFAULT_TIMEOUT_S = dist.default_pg_timeout.total_seconds()


def _new_group(ranks: list[int] | None, backend: str | None, timeout_s: float) -> dist.ProcessGroup:
    return dist.new_group(ranks=ranks, backend=backend, timeout=datetime.timedelta(seconds=timeout_s))


@dataclass(frozen=True)
class ParallelState:
    """Sizes, ranks and process groups of the dp x sp mesh. `mesh is None` means single process."""

    dp_size: int = 1
    sp_size: int = 1
    dp_rank: int = 0
    sp_rank: int = 0
    mesh: DeviceMesh | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    dp_replicate: int = 1
    hsdp_mesh: DeviceMesh | None = None
    ep_size: int = 1
    ep_mesh: DeviceMesh | None = None  # ("efsdp", "ep"), with ep_size > 1

    @property
    def world_size(self) -> int:
        return self.dp_size * self.sp_size

    @property
    def fsdp_size(self) -> int:
        """VeOmni's name for the ranks FSDP averages gradients over: dp x sp (with HSDP as without)."""
        return self.dp_size * self.sp_size

    @property
    def rank(self) -> int:
        return self.dp_rank * self.sp_size + self.sp_rank

    @property
    def is_distributed(self) -> bool:
        return self.mesh is not None

    @property
    def sp_enabled(self) -> bool:
        return self.sp_size > 1

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.mesh.get_group("dp") if self.mesh is not None else None

    @property
    def sp_group(self) -> dist.ProcessGroup | None:
        return self.mesh.get_group("sp") if self.mesh is not None else None

    @property
    def world_group(self) -> dist.ProcessGroup | None:
        """The dp x sp group: every rank of the mesh, i.e. the default process group."""
        return dist.group.WORLD if self.mesh is not None else None

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The ranks among which one MoE layer's experts are split (None without expert parallelism)."""
        return self.ep_mesh.get_group("ep") if self.ep_mesh is not None else None

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_size

    @property
    def device_type(self) -> str:
        return self.mesh.device_type if self.mesh is not None else "cpu"

    def new_group(self, backend: str | None = "gloo") -> dist.ProcessGroup | None:
        """A new group over every rank with this state's timeout (None without a process group). Collective: every
        rank calls it, in the same order as its other group creations."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return _new_group(None, backend, self.timeout_s)

    def fsdp_mesh(self) -> DeviceMesh | None:
        """FSDP2's mesh: 1-D over all dp x sp ranks, or under HSDP the 2-D ("replicate", "shard") mesh."""
        if self.mesh is None:
            return None
        if self.hsdp_mesh is not None:
            return self.hsdp_mesh
        return DeviceMesh.from_group(dist.group.WORLD, self.mesh.device_type, mesh_dim_names=("dp_sp",))


_STATE: ParallelState | None = None


def validate_layout(dp_size: int, sp_size: int, world_size: int, dp_replicate: int = 1, ep_size: int = 1) -> None:
    """Raise ValueError naming the numbers when dp_size x sp_size does not equal world_size, dp_replicate does not
    divide dp_size, or ep_size does not divide world_size / dp_replicate."""
    if dp_size < 1 or sp_size < 1 or dp_replicate < 1 or ep_size < 1:
        raise ValueError(
            f"dp_size ({dp_size}), sp_size ({sp_size}), dp_replicate ({dp_replicate}) and ep_size ({ep_size}) must "
            "be >= 1"
        )
    if world_size % (ep_size * dp_replicate):
        raise ValueError(
            f"parallel.ep_size ({ep_size}) does not divide the ranks of an HSDP shard block ({world_size} = dp x sp, "
            f"/ dp_replicate {dp_replicate})"
        )
    if dp_size * sp_size != world_size:
        raise ValueError(
            f"parallel layout does not fit the world: dp_size ({dp_size}) x sp_size ({sp_size}) = "
            f"{dp_size * sp_size} != world_size ({world_size})"
        )
    if dp_size % dp_replicate:
        raise ValueError(
            f"parallel.dp_replicate ({dp_replicate}) does not divide the dp size ({dp_size}): each replica must hold "
            "whole sp groups"
        )


def _mesh(
    dp_size: int, sp_size: int, device_type: str, timeout_s: float, names: tuple[str, ...] = ("dp", "sp"), *more: int
) -> DeviceMesh:
    """The mesh of shape (dp_size, sp_size, *more) over the world, rank-major, from groups created here, so each
    carries `timeout_s` (init_device_mesh's do not)."""
    rank = dist.get_rank()
    shape = (dp_size, sp_size, *more)
    layout = torch.arange(math.prod(shape)).reshape(shape)
    mine = []
    for dim in range(len(shape)):  # every rank creates every group, in the same order
        found = None
        for ranks in layout.movedim(dim, -1).reshape(-1, shape[dim]).tolist():
            group = _new_group(ranks, None, timeout_s)
            found = group if rank in ranks else found
        mine.append(found)
    return DeviceMesh.from_group(mine, device_type, mesh=layout, mesh_dim_names=names)


def _hsdp_mesh(world_size: int, replicate: int, device_type: str, timeout_s: float) -> DeviceMesh:
    """FSDP2's ("replicate", "shard") mesh: shard blocks of world / replicate consecutive ranks, with `timeout_s`."""
    return _mesh(replicate, world_size // replicate, device_type, timeout_s, ("replicate", "shard"))


def init_parallel_state(
    dp_size: int,
    sp_size: int = 1,
    device_type: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    dp_replicate: int = 1,
    ep_size: int = 1,
) -> ParallelState:
    """Build the dp x sp DeviceMesh (and, with `dp_replicate` > 1, the HSDP mesh) over the initialized default
    process group and make it current.

    Without an initialized process group only dp_size = sp_size = dp_replicate = 1 is valid and the single-process
    state is set. The layout is validated before any collective runs. `timeout_s` bounds every collective on the
    groups created here and by `ParallelState.new_group`. `ep_size` > 1 adds the ("efsdp", "ep") mesh.
    """
    global _STATE
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    validate_layout(dp_size, sp_size, world_size, dp_replicate, ep_size)
    if not dist.is_initialized():
        _STATE = ParallelState(timeout_s=timeout_s)
        return _STATE
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = _mesh(dp_size, sp_size, device_type, timeout_s)
    hsdp = _hsdp_mesh(world_size, dp_replicate, device_type, timeout_s) if dp_replicate > 1 else None
    ep_mesh = None
    if ep_size > 1 and dp_replicate > 1:
        names = ("replicate", "efsdp", "ep")
        ep_mesh = _mesh(dp_replicate, world_size // dp_replicate // ep_size, device_type, timeout_s, names, ep_size)
    elif ep_size > 1:
        ep_mesh = _mesh(world_size // ep_size, ep_size, device_type, timeout_s, ("efsdp", "ep"))
    _STATE = ParallelState(
        dp_size=dp_size,
        sp_size=sp_size,
        dp_rank=mesh.get_local_rank("dp"),
        sp_rank=mesh.get_local_rank("sp"),
        mesh=mesh,
        timeout_s=timeout_s,
        dp_replicate=dp_replicate,
        hsdp_mesh=hsdp,
        ep_size=ep_size,
        ep_mesh=ep_mesh,
    )
    return _STATE


def get_parallel_state() -> ParallelState:
    """The current layout; a single-process state when `init_parallel_state` was not called."""
    return _STATE if _STATE is not None else ParallelState()


def destroy_parallel_state() -> None:
    """Forget the current layout (the process group itself is left to its owner)."""
    global _STATE
    _STATE = None
