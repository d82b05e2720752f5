"""The embedded rollout engine: `TransformersEngine`, transformers' `generate` on each rank, seeded per sample. It
makes no torch.distributed collective: each rank generates its own prompts.

Sampling in `TransformersEngine`: transformers' `generate` in greedy mode (KV cache, prompts left-padded with an
attention mask, up to `batch_size` rows a call, rows ordered by prompt length to keep the padding short) with a
processor list that makes its argmax an exact sample: transformers' own temperature, top-k and top-p warpers (in that
order), then Gumbel-max noise -log(-log(U)), U uniform, drawn for each row from a `torch.Generator` seeded by (the row's
seed, the decode position). A sample is therefore a function of its prompt, seed, weights and settings alone, not of
the rows sharing its batch, the batch size or the rank, up to the rounding of batched kernels: left padding and batch
size move float32 logits by about 1e-7 on CPU, and a token flips only when two noisy scores are that close (not seen
in `benchmarks/rl_generation.py`'s check). The noise comes from the device's generator: CPU and CUDA draw different
samples for one seed. `greedy`: no warpers, no noise. A request's samples (consecutive rows) share their prompt's
prefill: all but its last token run once per request into the KV cache, repeated to its rows (`share_prompts`; not for
vision-language models), so `num_generations` samples cost one prompt forward, not `num_generations`.

Log-probabilities: each sampled token's log-softmax of the raw logits / temperature (before top-k and top-p), taken
at the step that samples it (the trainer recomputes the same quantity), so no [rows, steps, vocab] logits are kept.

Routing replay (`record_experts`, `rl.routing_replay: rollout`): every forward of a `generate` call records each
MoE layer's chosen experts (`record_every_forward`: the (shared) prefill, then one token per row per decode step),
and each rollout gets its prompt's and response's [tokens, layers, top_k] (`Rollout.routed_experts`); a shared
prefill's experts are its request's rows' alike.

Vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): a request's `model_inputs` (`pixel_values`,
`image_grid_thw` as the image processor returns them) are concatenated over a call's rows in row order, each prompt's
images once per sample, and `mm_token_type_ids` is derived from the placeholder ids, from which transformers computes
the M-RoPE positions of the left-padded rows. How many placeholders an image takes is the family's rule, given as
`image_tokens` (the model directory's `ImageProcessing.token_counts`); the engine names no family.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from veomni_lite.engines.base import Rollout, RolloutEngine, RolloutRequest, SamplingSettings
from veomni_lite.models.routing import compact_experts, record_every_forward

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_MASK64 = (1 << 64) - 1


def noise_seed(seed: int, position: int) -> int:
    """The generator seed of a row's noise at decode `position` (0 = the first response token): splitmix64 of the
    two, so nearby seeds and positions give unrelated streams (a CPU generator keeps only the low 32 bits)."""

    def mix(x: int) -> int:
        x = (x + 0x9E3779B97F4A7C15) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        return x ^ (x >> 31)

    return mix(mix(seed & _MASK64) ^ position)


def _processors(
    settings: SamplingSettings, seeds: Sequence[int], offsets: Sequence[int], prompt_width: int, device: torch.device
) -> Any:
    """The logits processors of one `generate` call, and the recorder that holds each step's tokens and log-probs."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    raw = _RawLogits()
    steps: list[Any] = [raw]
    if settings.suppress_ids:
        from transformers import SuppressTokensLogitsProcessor

        steps.append(SuppressTokensLogitsProcessor(list(settings.suppress_ids), device=device))
    if not settings.greedy:
        steps.append(TemperatureLogitsWarper(settings.temperature))
        if settings.top_k > 0:
            steps.append(TopKLogitsWarper(settings.top_k))
        if settings.top_p < 1:
            steps.append(TopPLogitsWarper(settings.top_p))
        steps.append(_SeededGumbelMax(seeds, offsets, prompt_width, device))
    record = _Chosen(raw, settings.temperature)
    return LogitsProcessorList([*steps, record]), record


class _RawLogits:
    """First processor: keeps the step's raw logits for `_Chosen`."""

    scores: torch.Tensor

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.scores = scores
        return scores


class _SeededGumbelMax:
    """Adds Gumbel noise -log(-log(U)), U uniform, row r's drawn from a generator seeded by noise_seed(seeds[r],
    position + offsets[r]): the argmax of the result is an exact sample of softmax(scores) (filtered tokens stay
    -inf); a row's offset is the response tokens its prompt already holds (`RolloutRequest.continued`)."""

    def __init__(self, seeds: Sequence[int], offsets: Sequence[int], prompt_width: int, device: torch.device) -> None:
        self.seeds = list(seeds)
        self.offsets = list(offsets)
        self.prompt_width = prompt_width
        self.generator = torch.Generator(device=device)
        self.noise: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        position = input_ids.shape[1] - self.prompt_width
        if self.noise is None or self.noise.shape != scores.shape:
            self.noise = torch.empty_like(scores)
        # one short call per row (exponential_ is 4x slower on CPU)
        for row, seed, offset in zip(self.noise, self.seeds, self.offsets):
            row.uniform_(generator=self.generator.manual_seed(noise_seed(seed, position + offset)))
        tiny = torch.finfo(scores.dtype).tiny  # U > 0: the noise is finite, a filtered -inf stays -inf
        return scores - self.noise.clamp_min_(tiny).log_().neg_().log_()


class _Chosen:
    """Last processor: the token `generate` picks (the argmax of the final scores) and its log-probability under
    softmax(raw logits / temperature), per step."""

    def __init__(self, raw: _RawLogits, temperature: float) -> None:
        self.raw = raw
        self.temperature = temperature
        self.tokens: list[torch.Tensor] = []
        self.logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        chosen = scores.argmax(dim=-1, keepdim=True)
        logits = self.raw.scores.float() / self.temperature
        self.tokens.append(chosen[:, 0])
        self.logprobs.append(logits.gather(-1, chosen)[:, 0] - torch.logsumexp(logits, dim=-1))
        return scores


class TransformersEngine(RolloutEngine):
    """Rollouts from a plain (unsharded) transformers model through its own `generate` (see the module docstring).
    The engine owns `hf_model`: it moves it to `device`, puts it in eval mode and replaces its generation config with
    transformers' defaults, so no sampling setting of a model directory (a repetition penalty, say) applies.
    `record_experts`: each rollout carries the experts its tokens were routed to (module docstring)."""

    name = "transformers"

    def __init__(
        self,
        hf_model: PreTrainedModel,
        device: torch.device,
        batch_size: int = 64,
        share_prompts: bool = True,
        image_tokens: Callable[[torch.Tensor], list[int]] | None = None,
        record_experts: bool = False,
    ) -> None:
        """`image_tokens`: a vision-language model's placeholder tokens of each image of an `image_grid_thw`
        (`ImageProcessing.token_counts`: the family's rule); required for one, unused otherwise."""
        from transformers import GenerationConfig

        if batch_size < 1:
            raise ValueError(f"TransformersEngine batch_size must be >= 1, got {batch_size}")
        config = hf_model.config
        self.placeholders = {1: getattr(config, "image_token_id", None), 2: getattr(config, "video_token_id", None)}
        self.vision = self.placeholders[1] is not None
        if self.vision and image_tokens is None:
            raise ValueError(
                f"TransformersEngine: {type(hf_model).__name__} takes images; pass image_tokens (the model directory's "
                "ImageProcessing.token_counts) so each request's placeholders can be checked against its images"
            )
        self.image_tokens = image_tokens
        self.model = hf_model.to(device).eval().requires_grad_(False)
        self.model.generation_config = GenerationConfig()
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.share_prompts = share_prompts
        self.record_experts = record_experts
        self.pad_id = config.get_text_config().pad_token_id

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        expected = set(self.model.state_dict())
        missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        if missing or unexpected:
            raise ValueError(
                f"TransformersEngine.sync_weights (version {version}): the weights do not match the engine's "
                f"{type(self.model).__name__}: missing keys {missing}, unexpected keys {unexpected}"
            )
        with torch.no_grad():
            self.model.load_state_dict(state_dict, strict=True)
        self._version = version

    def generate(self, requests: Sequence[RolloutRequest], settings: SamplingSettings) -> list[list[Rollout]]:
        for index, request in enumerate(requests):
            if not request.prompt_ids:
                raise ValueError(f"TransformersEngine.generate: request {index} has an empty prompt")
            if self.vision:
                self._check_images(index, request)
        rows = [(i, j) for i, request in enumerate(requests) for j in range(len(request.seeds))]
        rows.sort(key=lambda row: len(requests[row[0]].prompt_ids))  # stable: short padding, same order per length
        out: list[list[Rollout | None]] = [[None] * len(request.seeds) for request in requests]
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start : start + self.batch_size]
            for (i, j), rollout in zip(chunk, self._generate_rows(requests, chunk, settings)):
                out[i][j] = rollout
        return out  # type: ignore[return-value]

    def _generate_rows(
        self, requests: Sequence[RolloutRequest], rows: Sequence[tuple[int, int]], settings: SamplingSettings
    ) -> list[Rollout]:
        from transformers import GenerationConfig

        prompts = [requests[i].prompt_ids for i, _ in rows]
        width = max(len(prompt) for prompt in prompts)
        pad = self.pad_id if self.pad_id is not None else (settings.stop_ids or (0,))[0]
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: every row's last prompt token in the last column
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, **self._model_inputs(requests, rows)}
        if self.vision:
            kinds = torch.zeros_like(input_ids)
            for kind, token in self.placeholders.items():
                if token is not None:
                    kinds[input_ids == token] = kind
            inputs["mm_token_type_ids"] = kinds * attention_mask
        config = GenerationConfig(
            max_new_tokens=settings.max_new_tokens,
            do_sample=False,
            num_beams=1,
            eos_token_id=list(settings.stop_ids) or None,
            pad_token_id=pad,
            use_cache=True,
            return_dict_in_generate=True,
        )
        seeds = [requests[i].seeds[j] for i, j in rows]
        offsets = [requests[i].continued for i, _ in rows]
        processors, record = _processors(settings, seeds, offsets, width, self.device)
        inputs = {key: value.to(self.device) for key, value in inputs.items()}
        recording = record_every_forward(self.model) if self.record_experts else contextlib.nullcontext()
        with torch.no_grad(), recording as calls:
            if self.share_prompts and not self.vision:
                inputs.update(self._shared_prefill(rows, inputs["input_ids"], inputs["attention_mask"]))
            generated = self.model.generate(**inputs, generation_config=config, logits_processor=processors)
        tokens = generated.sequences[:, width:].tolist()
        steps = len(tokens[0])
        chosen = torch.stack(record.tokens[:steps], dim=1).tolist()
        logprobs = torch.stack(record.logprobs[:steps], dim=1).tolist()
        stops = set(settings.stop_ids)
        columns = self._routed_columns(calls, rows, "cache" in inputs, width) if calls is not None else None
        rollouts = []
        for row, response in enumerate(tokens):
            end = next((t + 1 for t, token in enumerate(response) if token in stops), None)
            response = response[: end or settings.max_new_tokens]
            if chosen[row][: len(response)] != response:  # a processor after ours changed the scores
                raise RuntimeError("TransformersEngine: generate did not take the sampler's tokens")
            reason = "length" if end is None else "stop"
            experts = None
            if columns is not None:  # the last response token never runs: experts 0..top_k-1
                fed = columns[row, width - len(prompts[row]) : width + len(response) - 1]
                last = torch.arange(fed.shape[-1], dtype=fed.dtype).expand(1, *fed.shape[1:])
                experts = torch.cat([fed, last])
            rollouts.append(Rollout(response, logprobs[row][: len(response)], reason, experts))
        return rollouts

    @staticmethod
    def _routed_columns(
        calls: list[list[torch.Tensor]], rows: Sequence[tuple[int, int]], shared: bool, width: int
    ) -> torch.Tensor:
        """A call's recording (per layer, per forward: [rows x columns, top_k]) as [rows, columns, layers, top_k] on
        the host, the columns the left-padded prompt's then one per decode step; `shared`: the first forward was the
        shared prefill of each request's first row (all but the last prompt column), repeated to its rows."""
        owner = torch.tensor([i for i, _ in rows]).unique_consecutive(return_inverse=True)[1]
        layers = []
        for forwards in calls:
            top_k, first = forwards[0].shape[-1], forwards[0]
            first = (
                first.view(-1, width - 1, top_k)[owner.to(first.device)] if shared else first.view(len(rows), -1, top_k)
            )
            layers.append(torch.cat([first, *(f.view(len(rows), -1, top_k) for f in forwards[1:])], dim=1))
        return compact_experts(torch.stack(layers, dim=2))  # uint8 on the host for up to 256 experts

    def _shared_prefill(
        self, rows: Sequence[tuple[int, int]], input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> dict[str, Any]:
        """{"cache": the KV cache of every row's prompt but its last token}, computed once per request (a request's
        samples are consecutive rows) and repeated to its rows; {} when no two rows share a prompt. `generate` then
        runs only the last prompt token before decoding (positions as `generate` makes them from the mask)."""
        from transformers import DynamicCache

        owner = torch.tensor([i for i, _ in rows]).unique_consecutive(return_inverse=True)[1]
        firsts = [r for r in range(len(rows)) if r == 0 or owner[r] != owner[r - 1]]
        if len(firsts) == len(rows) or input_ids.shape[1] < 2:
            return {}
        ids, mask = input_ids[firsts, :-1], attention_mask[firsts, :-1]
        cache = DynamicCache(config=self.model.config)
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                   logits_to_keep=1)  # fmt: skip
        cache.batch_select_indices(owner.to(input_ids.device))
        return {"cache": cache}

    def _check_images(self, index: int, request: RolloutRequest) -> None:
        """The prompt's image placeholders are as many as its images' tokens (transformers would embed placeholders
        without pixels as text)."""
        placeholders = request.prompt_ids.count(self.placeholders[1])
        grid = request.model_inputs.get("image_grid_thw")
        tokens = 0 if grid is None else sum(self.image_tokens(grid))
        if placeholders != tokens:
            raise ValueError(
                f"TransformersEngine.generate: request {index} has {placeholders} image placeholder tokens but its "
                f"image_grid_thw makes {tokens} image tokens (each image's placeholder repeated to its token count)"
            )

    def _model_inputs(self, requests: Sequence[RolloutRequest], rows: Sequence[tuple[int, int]]) -> dict[str, Any]:
        """Each key of the rows' `model_inputs` concatenated on dim 0 in row order (a prompt's once per sample)."""
        keys = sorted({key for i, _ in rows for key in requests[i].model_inputs})
        return {
            key: torch.cat([requests[i].model_inputs[key] for i, _ in rows if key in requests[i].model_inputs])
            for key in keys
        }
