"""The embedded rollout engine (`veomni_lite.engines.embedded.TransformersEngine`) on tiny float32 models, one process.

Each property against a plain reference: a sample depends on its seed, not on its batch (control: transformers' own
sampler does depend on it); the first token's frequencies over many seeds are the filtered softmax (controls: the
wrong temperature, no top-p); recorded log-probabilities are a plain forward's log-softmax(logits / T) (controls:
without the temperature, after the filters); stop ids cut a response without changing its prefix; greedy is
transformers' own greedy `generate`; `sync_weights` loads exactly the given weights, refuses mismatched keys by name;
a prompt's samples share its prefill (the same samples as each row running the whole prompt); a Qwen2-VL prompt with
images generates the same tokens alone and left-padded in a batch.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from veomni_lite.engines.base import Rollout, RolloutRequest, SamplingSettings
from veomni_lite.engines.embedded import TransformersEngine

VOCAB = 64
CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Any:
    """One intra-op thread: these models are so small that a second thread only waits (10x slower on a busy host)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_lm(seed: int = 0, logit_scale: float = 1.0) -> Any:
    """A 2-layer Qwen2 of hidden 32, float32; `logit_scale` multiplies the LM head (spread-out logits)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model


def prompts(*lengths: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def responses(rollouts: list[list[Rollout]]) -> list[list[list[int]]]:
    return [[r.response_ids for r in group] for group in rollouts]


def forward_logits(model: Any, prompt: list[int], response: list[int], **inputs: Any) -> torch.Tensor:
    """float64 logits of a plain forward over prompt + response that predict the response tokens [n, V]."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt + response]), **inputs).logits[0, len(prompt) - 1 : -1].double()


def at(logprobs: torch.Tensor, response: list[int]) -> torch.Tensor:
    return logprobs.gather(-1, torch.tensor(response)[:, None])[:, 0]


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask


SETTINGS = SamplingSettings(max_new_tokens=8, temperature=0.9, top_k=20, top_p=0.95)


def test_a_sample_depends_on_its_seed_not_on_its_batch() -> None:
    model = tiny_lm()
    requests = [RolloutRequest(p, [100 * i + j for j in range(3)]) for i, p in enumerate(prompts(3, 7, 12, 5))]
    batched = responses(TransformersEngine(model, CPU).generate(requests, SETTINGS))
    other_rank = TransformersEngine(copy.deepcopy(model), CPU, batch_size=2)  # other batches, sizes, padding
    assert responses(other_rank.generate(requests, SETTINGS)) == batched
    for request, expected in zip(requests, batched):
        assert responses(other_rank.generate([request], SETTINGS)) == [expected]
    last = requests[2]  # one seed alone, out of its group: the same sample
    assert responses(other_rank.generate([RolloutRequest(last.prompt_ids, last.seeds[2:])], SETTINGS)) == [
        batched[2][2:]
    ]
    for group in batched:  # different seeds, different samples
        assert len({tuple(r) for r in group}) == len(group)
        assert all(len(r) == SETTINGS.max_new_tokens for r in group)
    # Control: transformers' own sampler (one generator for the batch) gives a prompt other tokens once batched.
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=True, max_new_tokens=8, temperature=0.9, top_k=20, pad_token_id=0)
    torch.manual_seed(0)
    ids, mask = left_pad([requests[3].prompt_ids])
    theirs_alone = model.generate(ids, attention_mask=mask, generation_config=config)[0, -8:]
    torch.manual_seed(0)
    ids, mask = left_pad([requests[0].prompt_ids, requests[3].prompt_ids])
    theirs_together = model.generate(ids, attention_mask=mask, generation_config=config)[1, -8:]
    assert not torch.equal(theirs_alone, theirs_together)


def test_a_prompts_samples_share_its_prefill() -> None:
    """The rows of one request run its prompt once (all but its last token, into the KV cache repeated to its rows):
    the same tokens and log-probabilities as each row running the whole prompt."""
    model = tiny_lm(logit_scale=4.0)
    requests = [RolloutRequest(p, [10 * i + j for j in range(4)]) for i, p in enumerate(prompts(5, 9, 3, 9))]
    shapes: list[tuple[int, int]] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    try:
        shared = TransformersEngine(model, CPU, batch_size=12).generate(requests, SETTINGS)
        prefills, shapes[:] = list(shapes), []
        whole = TransformersEngine(copy.deepcopy(model), CPU, batch_size=12, share_prompts=False).generate(
            requests, SETTINGS
        )
    finally:
        hook.remove()
    # rows ordered by prompt length (3, 5, 9, 9) in chunks of 12: three prompts, then one; each prefilled once
    assert [shape for shape in prefills if shape[1] > 1] == [(3, 8), (1, 8)]
    assert [shape for shape in prefills if shape[1] == 1][:1] == [(12, 1)]  # the last prompt token, every row
    assert responses(shared) == responses(whole)
    for group, reference in zip(shared, whole):
        for rollout, expected in zip(group, reference):
            torch.testing.assert_close(rollout.logprobs, expected.logprobs, rtol=0, atol=1e-6)


def reference_first_token(model: Any, prompt: list[int], temperature: float, top_k: int, top_p: float) -> Any:
    """softmax of the logits / T restricted to the top-k, then to the smallest top set holding top_p of the mass."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].double() / temperature
    probs = torch.zeros_like(logits)
    kept = logits.topk(top_k).indices if top_k else torch.arange(len(logits))
    probs[kept] = torch.softmax(logits[kept], dim=-1)
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]  # the mass of the tokens ranked above each
    probs[order[before >= top_p]] = 0
    return probs / probs.sum()


def test_first_token_frequencies_are_the_filtered_softmax() -> None:
    model = tiny_lm(logit_scale=12.0)
    prompt, draws = prompts(6)[0], 4000
    settings = SamplingSettings(max_new_tokens=1, temperature=0.7, top_k=12, top_p=0.9)
    engine = TransformersEngine(model, CPU, batch_size=1000)
    rollouts = engine.generate([RolloutRequest(prompt, list(range(draws)))], settings)[0]
    counts = torch.bincount(torch.tensor([r.response_ids[0] for r in rollouts]), minlength=VOCAB).double()
    frequencies = counts / draws

    def error_ok(probs: torch.Tensor) -> bool:
        """Every frequency within 5 standard errors of `probs`, and tokens of probability 0 never drawn."""
        bound = 5 * (probs * (1 - probs) / draws).sqrt()
        return bool(((frequencies - probs).abs() <= bound).all()) and bool((counts[probs == 0] == 0).all())

    expected = reference_first_token(model, prompt, 0.7, 12, 0.9)
    assert 3 <= int((expected > 0).sum()) < 12, "the test needs top-p to cut inside the top-k"
    assert error_ok(expected)
    assert not error_ok(reference_first_token(model, prompt, 1.0, 12, 0.9))  # control: the wrong temperature
    assert not error_ok(reference_first_token(model, prompt, 0.7, 12, 1.0))  # control: without top-p


def test_logprobs_are_a_plain_forwards_and_stops_cut_responses() -> None:
    model = tiny_lm(logit_scale=4.0)
    requests = [RolloutRequest(p, [7 * i + j for j in range(4)]) for i, p in enumerate(prompts(4, 9, 6))]
    settings = SamplingSettings(max_new_tokens=10, temperature=0.8, top_k=10)
    engine = TransformersEngine(model, CPU)
    free = engine.generate(requests, settings)
    errors: dict[str, list[float]] = {"plain": [], "no temperature": [], "after top-k": []}
    for request, group in zip(requests, free):
        for rollout in group:
            assert rollout.finish_reason == "length" and len(rollout.response_ids) == 10
            got = torch.tensor(rollout.logprobs, dtype=torch.float64)
            logits = forward_logits(model, request.prompt_ids, rollout.response_ids)
            top_k = logits.masked_fill(logits < logits.topk(10).values[:, -1:], float("-inf"))
            references = {
                "plain": torch.log_softmax(logits / 0.8, dim=-1),
                "no temperature": torch.log_softmax(logits, dim=-1),
                "after top-k": torch.log_softmax(top_k / 0.8, dim=-1),
            }
            for name, reference in references.items():
                errors[name].append(float((got - at(reference, rollout.response_ids)).abs().max()))
    assert max(errors["plain"]) <= 1e-5
    assert min(errors["no temperature"]) > 1e-2 and min(errors["after top-k"]) > 1e-2  # controls
    # Stop ids: a token at position >= 2 of two samples; each response ends at its first stop, its prefix unchanged.
    stops = tuple(next(t for t in free[g][0].response_ids[2:] if t not in free[g][0].response_ids[:2]) for g in (0, 1))
    stopped = engine.generate(requests, SamplingSettings(**{**vars(settings), "stop_ids": stops}))
    reasons = []
    for old_group, new_group in zip(free, stopped):
        for old, new in zip(old_group, new_group):
            end = next((t + 1 for t, token in enumerate(old.response_ids) if token in stops), 10)
            assert new.response_ids == old.response_ids[:end]
            assert new.finish_reason == ("stop" if new.response_ids[-1] in stops else "length")
            torch.testing.assert_close(new.logprobs, old.logprobs[:end], rtol=0, atol=1e-6)
            reasons.append(new.finish_reason)
    assert reasons.count("stop") >= 2 and "length" in reasons


def test_greedy_is_transformers_greedy() -> None:
    from transformers import GenerationConfig

    model = tiny_lm(logit_scale=4.0)
    requests = [RolloutRequest(p, [i, i + 50]) for i, p in enumerate(prompts(5, 11, 3))]
    engine = TransformersEngine(model, CPU)
    cold = engine.generate(requests, SamplingSettings(max_new_tokens=12, greedy=True, temperature=0.5))
    hot = engine.generate(requests, SamplingSettings(max_new_tokens=12, greedy=True, temperature=2.0))
    sampled = engine.generate(requests, SamplingSettings(max_new_tokens=12))
    assert responses(cold) == responses(hot)  # the temperature only scales the log-probabilities
    assert responses(sampled) != responses(cold)  # control: sampling differs
    for request, group in zip(requests, cold):
        ids, mask = left_pad([request.prompt_ids])  # a mask: a prompt token equal to the pad id is no padding
        config = GenerationConfig(do_sample=False, max_new_tokens=12, pad_token_id=0)
        theirs = model.generate(ids, attention_mask=mask, generation_config=config)[0, ids.shape[1] :].tolist()
        assert [r.response_ids for r in group] == [theirs, theirs]  # seeds play no part
        expected = at(torch.log_softmax(forward_logits(model, request.prompt_ids, theirs) / 0.5, dim=-1), theirs)
        torch.testing.assert_close(torch.tensor(group[0].logprobs, dtype=torch.float64), expected, rtol=0, atol=1e-5)


def test_sync_weights_loads_exactly_the_given_weights() -> None:
    requests = [RolloutRequest(p, [3, 4]) for p in prompts(4, 6)]
    settings = SamplingSettings(max_new_tokens=6)
    engine = TransformersEngine(tiny_lm(seed=0), CPU)
    assert engine.version == -1 and engine.name == "transformers"
    before = responses(engine.generate(requests, settings))
    other = tiny_lm(seed=1)
    expected = responses(TransformersEngine(copy.deepcopy(other), CPU).generate(requests, settings))
    assert expected != before  # control: other weights sample otherwise
    weights = {name: tensor.clone() for name, tensor in other.state_dict().items()}
    engine.sync_weights(weights, version=3)
    assert engine.version == 3
    assert responses(engine.generate(requests, settings)) == expected
    for tensor in weights.values():  # the engine copied them: the caller may reuse its buffers
        tensor.zero_()
    assert responses(engine.generate(requests, settings)) == expected
    bad = {name: tensor for name, tensor in other.state_dict().items() if name != "lm_head.weight"}
    with pytest.raises(ValueError, match=r"version 4.*missing keys \['lm_head\.weight'\], unexpected keys \[\]"):
        engine.sync_weights(bad, version=4)
    bad = {**other.state_dict(), "model.extra.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"missing keys \[\], unexpected keys \['model\.extra\.weight'\]"):
        engine.sync_weights(bad, version=4)
    assert engine.version == 3
    assert responses(engine.generate(requests, settings)) == expected  # nothing of a refused sync was loaded


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be >= 0"),
    ],
)
def test_bad_settings_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingSettings(**{"max_new_tokens": 4, **fields})


@pytest.fixture(scope="session")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/sft_demo.py's tiny Qwen2-VL directory (weights, tokenizer, image processor), without the digits."""
    from examples.sft_demo import PROMPT, WORDS, write_vl_model

    directory = tmp_path_factory.mktemp("rl_vl") / "qwen2_vl"
    write_vl_model(directory, [PROMPT, *(f"a handwritten {word}" for word in WORDS)])
    return directory


def vl_request(directory: Path, heights: list[int], text: str, seeds: list[int]) -> RolloutRequest:
    """A user turn of random RGB images of 8 pixels wide and `heights` tall, then `text`, rendered with the generation
    prompt; each image placeholder repeated to its token count, as the SFT data path does."""
    from PIL import Image

    from veomni_lite.models.pretrained import load_config, load_image_processor, load_tokenizer

    image_token = load_config(directory).image_token_id
    generator = torch.Generator().manual_seed(sum(heights) + len(text))
    images = [Image.fromarray(torch.randint(0, 256, (h, 8, 3), generator=generator).byte().numpy()) for h in heights]
    pixels = load_image_processor(directory)(images=images, return_tensors="pt")
    messages = [{"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]}]
    rendered = load_tokenizer(directory).apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = load_tokenizer(directory)(rendered)["input_ids"]
    counts = iter((pixels["image_grid_thw"].prod(-1) // 4).tolist())  # 2x2 patches merged into one token
    prompt = [t for token in ids for t in ([token] * next(counts) if token == image_token else [token])]
    return RolloutRequest(prompt, seeds, {key: pixels[key] for key in ("pixel_values", "image_grid_thw")})


def test_vision_language_prompts_generate_alone_as_in_a_batch(vl_dir: Path) -> None:
    from transformers import Qwen2VLForConditionalGeneration

    from veomni_lite.models.pretrained import read_model_directory

    model = Qwen2VLForConditionalGeneration.from_pretrained(str(vl_dir), dtype=torch.float32)
    image_token = model.config.image_token_id
    one = vl_request(vl_dir, [8], "What digit is this?", [1, 2])
    two = vl_request(vl_dir, [8, 16], "What digits are these? What digits?", [3, 4])
    assert len(one.prompt_ids) < len(two.prompt_ids) and one.prompt_ids.count(image_token) == 4
    settings = SamplingSettings(max_new_tokens=6, temperature=1.0)
    with pytest.raises(ValueError, match="Qwen2VLForConditionalGeneration takes images; pass image_tokens"):
        TransformersEngine(model, CPU)  # the placeholder count is the family's rule, which the engine does not guess
    engine = TransformersEngine(model, CPU, image_tokens=read_model_directory(vl_dir).images.token_counts)
    batched = engine.generate([two, one], settings)
    assert responses(engine.generate([one], settings)) == responses(batched[1:])
    assert responses(engine.generate([two], settings)) == responses(batched[:1])
    assert responses(engine.generate([two, one], settings)) == responses(batched)
    for request, group in zip([two, one], batched):
        assert group[0].response_ids != group[1].response_ids
        for rollout in group:  # the left-padded rows' M-RoPE positions are the unpadded ones
            ids = torch.tensor([request.prompt_ids + rollout.response_ids])
            inputs = {"mm_token_type_ids": (ids == image_token).long(), **request.model_inputs}
            logits = forward_logits(model, request.prompt_ids, rollout.response_ids, **inputs)
            expected = at(torch.log_softmax(logits, dim=-1), rollout.response_ids)
            torch.testing.assert_close(torch.tensor(rollout.logprobs, dtype=torch.float64), expected, rtol=0, atol=1e-5)
    # Control: other pixels of the same size, other log-probabilities (the pixels reach the model).
    negative = {**one.model_inputs, "pixel_values": -one.model_inputs["pixel_values"]}
    seen = engine.generate([RolloutRequest(one.prompt_ids, one.seeds, negative)], settings)[0][0].logprobs
    assert max(abs(a - b) for a, b in zip(seen, batched[1][0].logprobs)) > 1e-3
    with pytest.raises(ValueError, match="request 0 has 4 image placeholder tokens but its image_grid_thw makes 0"):
        engine.generate([RolloutRequest(one.prompt_ids, one.seeds)], settings)
    with pytest.raises(ValueError, match="request 1 has 4 image placeholder tokens but its image_grid_thw makes 12"):
        engine.generate([one, RolloutRequest(one.prompt_ids, one.seeds, two.model_inputs)], settings)
