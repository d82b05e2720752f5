"""Rollout engines: prompts and sampling settings in; sampled token ids, their log-probabilities and why each
response ended, out.

`RolloutEngine` is the interface every engine implements: the embedded engine (`veomni_lite.engines.embedded`:
transformers' `generate` on each rank) and a vLLM server (`veomni_lite.engines.vllm`). The trainer loads the policy's
full weights into it (`sync_weights`, transformers' parameter names; `veomni_lite.engines.weights` gathers them) and
asks for one sample per seed of each prompt (`generate`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Rollout", "RolloutEngine", "RolloutRequest", "SamplingSettings"]


@dataclass(frozen=True)
class SamplingSettings:
    """How responses are drawn. Filters apply in transformers' order: temperature, then top-k, then top-p."""

    max_new_tokens: int
    temperature: float = 1.0
    """> 0; the log-probabilities are of softmax(logits / temperature), greedy included."""
    top_p: float = 1.0
    """In (0, 1]; 1 = off."""
    top_k: int = 0
    """0 = off."""
    stop_ids: tuple[int, ...] = ()
    """End-of-turn ids: a response ends with the first one it emits (kept in the response)."""
    greedy: bool = False
    """Evaluation: the argmax of the logits, no filter, no noise."""
    suppress_ids: tuple[int, ...] = ()
    """Ids never drawn (greedy too), e.g. a VL model's image placeholder, which only a prompt's image may hold."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingSettings.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"SamplingSettings.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingSettings.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingSettings.top_k must be >= 0 (0 = off), got {self.top_k}")


@dataclass
class RolloutRequest:
    """One prompt and the seeds of its samples."""

    prompt_ids: list[int]
    """The rendered prompt (VL: each image's placeholder already repeated to its token count, as in SFT data)."""
    seeds: list[int]
    """One per sample (len = num_generations); sample j is drawn with seeds[j]."""
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """VL: `pixel_values` and `image_grid_thw` of this prompt's images, as the image processor returns them."""
    chat: dict[str, Any] = field(default_factory=dict)
    """VL, for an engine that renders prompts itself (vLLM): the fields of an OpenAI chat request that give this prompt
    (`prompts.chat_fields`); the engine checks that its rendering is `prompt_ids`."""


@dataclass
class Rollout:
    """One sampled response."""

    response_ids: list[int]
    logprobs: list[float]
    """Per response token: its log-probability under softmax(logits / temperature), before top-k and top-p."""
    finish_reason: str
    """"stop" (ended with a stop id) or "length" (cut at max_new_tokens)."""
    routed_experts: torch.Tensor | None = None
    """Routing replay (an engine asked to record them): the experts each token of prompt + response was routed to,
    [tokens, MoE layers, top_k] (the last response token, never run, holds experts 0..top_k-1)."""


class RolloutEngine(ABC):
    """Generates rollouts with the weights last given to `sync_weights`; makes no collective."""

    name: str
    _version: int = -1

    @abstractmethod
    def sync_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load the policy's full weights, keyed as the transformers model's `state_dict()` (tied weights under each
        of their names), LoRA merged; `version` labels them. Mismatched keys: a ValueError naming them."""

    @abstractmethod
    def generate(self, requests: Sequence[RolloutRequest], settings: SamplingSettings) -> list[list[Rollout]]:
        """Per request, one `Rollout` per seed, in order."""

    def close(self) -> None:
        """Release what the engine holds (a server, a process); nothing for the embedded engine."""
        return None

    @property
    def version(self) -> int:
        """The weights version last synced (-1 before any)."""
        return self._version
