"""What the trainer needs from a model: the contract every model (tiny example or transformers wrapper) keeps.

It lives beside the models that implement it; `veomni_lite.trainer.model` re-exports it (the old import path).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class HostInput:
    """A `host_inputs` tensor as the trainer hands it to a model's forward. It is no pytree node, so FSDP2's root
    pre-forward, which moves every tensor argument to a CUDA device (a copy, and the model's reads of it then syncs),
    leaves it on the host; `on_host` unwraps it."""

    tensor: torch.Tensor


def on_host(value: Any) -> Any:
    """`value`'s tensor if it is a `HostInput`, else `value` itself (a bare tensor, None)."""
    return value.tensor if isinstance(value, HostInput) else value


class TrainableModel(nn.Module):
    """The base of every model the trainer trains.

    Required (a subclass defines them):
    - `forward(**micro_batch)` returns `{"<name>_loss": this rank's mean over its valid local tokens}` for every name
      in `loss_keys` (an exact, graph-keeping 0 for a head with no targets, never NaN);
    - `layers`: the blocks FSDP shards one by one;
    - `flops_per_token(full_seq_len)`: forward + backward FLOPs per token, for the throughput metrics;
    - `enable_sequence_parallel(sp_group)`: switch the attention to Ulysses over `sp_group` (called once, before
      sharding, only when sp_size > 1).

    Optional (the defaults here say what a model without them gets):
    - `host_inputs`: batch keys the trainer leaves on the host, because the model reads them there (boundaries,
      grids), so reading them costs no device sync; they arrive wrapped in `HostInput` (unwrap with `on_host`);
    - `set_attn_implementation(name)`: `model.attn_implementation`; the default refuses anything but sdpa;
    - `save_config(directory)` / `save_pretrained(directory)`: what `python -m veomni_lite.export` rebuilds the model
      from, and the export itself; the default writes nothing (the run then has no transformers format).
    """

    loss_keys: tuple[str, ...]  # an attribute or property of the subclass
    layers: Iterable[nn.Module]  # likewise (an nn.ModuleList attribute is one)
    host_inputs: tuple[str, ...] = ()
    companions: tuple[TrainableModel, ...] = ()  # see `with_companions`

    def flops_per_token(self, seq_len: int) -> float:
        raise NotImplementedError

    def enable_sequence_parallel(self, sp_group: dist.ProcessGroup) -> None:
        raise NotImplementedError

    def set_attn_implementation(self, name: str) -> None:
        raise ValueError(f"{type(self).__name__} runs its own attention (sdpa only)")

    def save_config(self, directory: str | Path) -> None:
        """Write what the export needs to rebuild this model into `directory` (nothing by default)."""

    def save_pretrained(self, directory: str | Path) -> list[str]:
        raise NotImplementedError(f"{type(self).__name__} has no transformers format to export")


_REQUIRED_METHODS = ("flops_per_token", "enable_sequence_parallel")


def with_companions(model: nn.Module) -> list[TrainableModel]:
    """`model` and the models it trains beside it (`companions`, e.g. PPO's separate value model,
    `rl.critic.pretrained_dir`: its submodules, which it runs in its forward): the trainer gives each the run's
    attention and Ulysses SP, and shards (and checkpoints the activations of) each one's `layers`. A model's own
    parts that are models too (a VL model's decoder) are not companions: the model covers them."""
    return [model, *getattr(model, "companions", ())]


def check_model_contract(model: nn.Module) -> TrainableModel:
    """Return `model` if it keeps the contract; else raise TypeError naming what it lacks (before any collective)."""
    if not isinstance(model, TrainableModel):
        raise TypeError(
            f"{type(model).__name__} does not keep the model contract: subclass "
            "veomni_lite.models.contract.TrainableModel and define its required members"
        )
    missing = [name for name in ("loss_keys", "layers") if not hasattr(model, name)]
    missing += [name for name in _REQUIRED_METHODS if getattr(type(model), name) is getattr(TrainableModel, name)]
    if missing:
        raise TypeError(
            f"{type(model).__name__} does not keep the model contract: it lacks {missing} (see TrainableModel)"
        )
    return model
