"""What the trainer needs from a model: the contract every model (tiny example or transformers wrapper) keeps."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist
from torch import Tensor, nn


@runtime_checkable
class TrainableModel(Protocol):
    """`forward(**micro_batch)` returns `{"<name>_loss": this rank's mean over its valid local tokens}` for every name
    in `loss_keys` (an exact, graph-keeping 0 for a head with no targets, never NaN).

    `layers` are the blocks FSDP shards one by one; `flops_per_token(full_seq_len)` the forward+backward FLOPs per
    token for the throughput metrics; `enable_sequence_parallel(sp_group)` switches the model's attention to Ulysses
    over `sp_group` (called once, before sharding, only when sp_size > 1). A model that can be exported also has
    `save_config(directory)` (what `veomni_lite.export` needs to rebuild it) and `save_pretrained(directory)`.
    """

    @property
    def loss_keys(self) -> tuple[str, ...]: ...

    @property
    def layers(self) -> Iterable[nn.Module]: ...

    def flops_per_token(self, seq_len: int) -> float: ...

    def enable_sequence_parallel(self, sp_group: dist.ProcessGroup) -> None: ...

    def __call__(self, **micro_batch: Any) -> Mapping[str, Tensor]: ...


_MEMBERS = ("loss_keys", "layers", "flops_per_token", "enable_sequence_parallel")


def check_model_contract(model: nn.Module) -> TrainableModel:
    """Return `model` if it keeps the contract; else raise TypeError naming what it lacks (before any collective)."""
    missing = [name for name in _MEMBERS if not hasattr(model, name)]
    if missing:
        raise TypeError(
            f"{type(model).__name__} does not keep the model contract: it lacks {missing} (see TrainableModel)"
        )
    return model  # type: ignore[return-value]
