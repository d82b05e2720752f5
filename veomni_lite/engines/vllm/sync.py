"""The weight sync's parts on rank 0 (the engine's `sync_weights` runs them, collectively): `write_weights` writes the
full weights (transformers' names, tied weights under each name) as `model.safetensors`, with the model's
`config.json`, into `rl.vllm.sync_dir`/<run>/; `reload` POSTs to one server (the engine does every server at once)
`/collective_rpc` `reload_weights` with that directory, then `/reset_prefix_cache` (a cached prompt would otherwise
reuse results of the old weights) and, for a vision-language model, `/reset_encoder_cache` (the images'
vision-encoder outputs are of the old weights too; without the reset vLLM 0.32's engine dies, "Encoder cache miss",
on the next wave of images it has seen), and returns the server's prompt log-probabilities of a fixed token sequence
(the probe); `judge` runs each server's sync check (`check.SyncCheck`) on them against the trainer's: a failed check
is an `EngineError` (the engine does not serve the trainer's weights).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from veomni_lite.engines.vllm.client import Client, Endpoint
from veomni_lite.engines.vllm.settings import NAME, EngineError

logger = logging.getLogger(__name__)


def write_weights(state_dict: Mapping[str, torch.Tensor], sync_path: Path, config_path: Path) -> None:
    """`model.safetensors` (+ config.json from `config_path`) in `sync_path`, the file replaced whole."""
    from safetensors.torch import save_file

    sync_path.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    tensors = {}
    for key, value in state_dict.items():
        value = value.detach().cpu().contiguous()
        if value.data_ptr() in seen:  # a tied weight: safetensors refuses shared storage, so its own copy
            value = value.clone()
        seen.add(value.data_ptr())
        tensors[key] = value
    tmp = sync_path / "model.safetensors.partial"  # not *.safetensors: a reload never reads a half file
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(sync_path / "model.safetensors")
    if config_path.is_file():
        shutil.copyfile(config_path, sync_path / "config.json")


def reload(
    client: Client, endpoint: Endpoint, sync_path: Path, version: int, probe_ids: list[int], renders_prompts: bool
) -> list[float]:
    """`endpoint` reloads the weights in `sync_path` and resets its caches; its log-probabilities of the probe."""
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(sync_path)}}
    client.call(endpoint, "POST", "/collective_rpc", body, f"reload the weights of version {version}")
    client.call(endpoint, "POST", "/reset_prefix_cache", None, "reset the prefix cache")
    if renders_prompts:  # images' encoder outputs of the old weights (see the module docstring)
        client.call(endpoint, "POST", "/reset_encoder_cache", None, "reset the encoder cache")
    return client.prompt_logprobs(endpoint, probe_ids)


def judge(
    endpoints: Sequence[Endpoint],
    version: int,
    engine_logprobs: Sequence[Sequence[float]],
    trainer_logprobs: Sequence[float],
    sync_s: tuple[float, float],
) -> tuple[EngineError | None, float]:
    """Each server's sync check of `version` (its log-probabilities of the probe against the trainer's): the first
    failure as an EngineError naming the server (None when every check passes), and the largest mean |engine -
    trainer| over the servers; logs a passed sync (`sync_s`: the seconds to write and to reload)."""
    problem = None
    for endpoint, values in zip(endpoints, engine_logprobs):
        verdict = endpoint.check(version, values, trainer_logprobs)
        if verdict is not None:
            problem = EngineError(f"{NAME} at {endpoint.url}: {verdict}")
            break
    gap = max(endpoint.check.gap for endpoint in endpoints)
    if problem is None:
        followed = [e.check.followed for e in endpoints if e.check.followed is not None]
        logger.info(
            "%s: weights of version %d synced to %d server(s) (write %.2f s, reload %.2f s); probe mean |diff| "
            "%.2e%s", NAME, version, len(endpoints), *sync_s, gap,
            f", followed the trainer's change {min(followed):.0%}" if followed else "",
        )  # fmt: skip
    return problem, gap
