"""The transformers wrappers in one process: M-RoPE positions against transformers' get_rope_index, loss heads without
targets (exact 0, zero finite gradients), and what `enable_sequence_parallel` checks and switches."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from examples.digits import DigitsDataset, train_tokenizer
from veomni_lite.loss_keys import IGNORE_INDEX, is_labels_key
from veomni_lite.models import hf_attention
from veomni_lite.models.hf_attention import ATTENTION_NAME, ulysses_attention_forward
from veomni_lite.models.hf_causal_lm import HFCausalLM, hf_config_from_dict
from veomni_lite.models.qwen2_vl import QwenVLWithImageHead, collate_qwen2_vl, mrope_positions

IMAGE, VISION_START, VISION_END, PAD = 6, 4, 5, 0
VOCAB = 40
TEXT_SETTINGS = {
    "model_type": "qwen2",
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


VL_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
_VISION = {"in_channels": 1, "patch_size": 2, "temporal_patch_size": 1, "spatial_merge_size": 2, "num_heads": 2}


def vl_config(vocab_size: int = VOCAB, family: str = "qwen2_vl"):
    """A tiny config of a Qwen VL `family` with the image head: 1 input channel, 2x2 patches merged 2x2, a decoder
    of width 32. Qwen2.5-VL gets windowed and full vision blocks (windows of 2x2 merged patches), Qwen3-VL a 4x4
    learned position grid and one deepstack layer."""
    import transformers

    text = {key: value for key, value in TEXT_SETTINGS.items() if key not in ("model_type", "vocab_size")}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    if family == "qwen2_vl":
        cls = transformers.Qwen2VLConfig
        vision = {"depth": 1, "embed_dim": 16, "mlp_ratio": 2, "hidden_size": 32}
    elif family == "qwen2_5_vl":
        cls = transformers.Qwen2_5_VLConfig
        vision = {"depth": 2, "hidden_size": 16, "intermediate_size": 32, "out_hidden_size": 32, "window_size": 8}
        vision["fullatt_block_indexes"] = [1]
    else:
        cls = transformers.Qwen3VLConfig
        vision = {"depth": 2, "hidden_size": 16, "intermediate_size": 32, "out_hidden_size": 32}
        vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0])
        text["head_dim"] = 8
        rope["mrope_interleaved"] = True
    return cls(
        text_config={**text, "vocab_size": vocab_size, "rope_parameters": rope},
        vision_config={**_VISION, **vision},
        image_token_id=IMAGE,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        image_decoder_classes=17,
    )


@pytest.fixture(scope="module")
def digits():
    return DigitsDataset(train_tokenizer(), "eval")


def make_vl(seed: int = 0, vocab_size: int = VOCAB, family: str = "qwen2_vl") -> QwenVLWithImageHead:
    torch.manual_seed(seed)
    return QwenVLWithImageHead.from_config(vl_config(vocab_size, family))


def _rms_norm(self: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return self.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def float64_norms(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every RMSNorm computing in its input's dtype. transformers' compute in float32 even for float64
    inputs, so a float64 test whose two sides sum a gradient in different orders (a shared prefix's branches) would
    differ by float32 rounding, not by what they compute."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_norm, module)
    return model


def make_lm(seed: int = 0) -> HFCausalLM:
    torch.manual_seed(seed)
    return HFCausalLM.from_config(hf_config_from_dict(TEXT_SETTINGS))


def image_sample(grids: list[tuple[int, int, int]], texts: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """Text runs of the given lengths around images of the given (t, h, w) patch grids (merge 2), in order."""
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for index, length in enumerate(texts):
        ids += torch.randint(10, VOCAB, (length,), generator=g).tolist()
        if index < len(grids):
            t, h, w = grids[index]
            ids += [VISION_START, *[IMAGE] * (t * h * w // 4), VISION_END]
    input_ids = torch.tensor(ids)
    patches = sum(t * h * w for t, h, w in grids)
    return {
        "input_ids": input_ids,
        "labels": input_ids.clone(),
        "image_decoder_labels": torch.full_like(input_ids, IGNORE_INDEX),
        "pixel_values": torch.randn(patches, 4, generator=g),
        "image_grid_thw": torch.tensor(grids),
    }


def text_sample(length: int, seed: int = 1) -> dict[str, torch.Tensor]:
    input_ids = torch.randint(10, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": input_ids, "labels": input_ids.clone(), "image_decoder_labels": input_ids % 17}


def rope_index(input_ids, grids, lengths, image_token_id: int = IMAGE):
    """transformers' own positions ([B, S, 3] on the unpadded tokens) from `Qwen2VLModel.get_rope_index`."""
    from transformers import Qwen2VLModel

    valid = (torch.arange(input_ids.shape[1]) < torch.tensor(lengths)[:, None]).long()
    model = Qwen2VLModel.__new__(Qwen2VLModel)  # get_rope_index reads only config.vision_config.spatial_merge_size
    model.config = vl_config()
    positions, _ = model.get_rope_index(input_ids, (input_ids == image_token_id).long(), grids, attention_mask=valid)
    return positions.permute(1, 2, 0), valid.bool()


def test_collate_positions_equal_get_rope_index_on_a_mixed_batch(digits):
    samples = [
        image_sample([(1, 4, 4), (1, 4, 8)], [3, 5, 2]),  # two images, one not square
        text_sample(9),  # generation-like: text only
        image_sample([(2, 4, 6)], [1, 4], seed=2),  # several frames, image first after one token
        image_sample([(1, 2, 2)], [0, 3], seed=3),  # the sequence starts with the image
        text_sample(4, seed=4),
    ]
    batch = collate_qwen2_vl(samples, IMAGE, merge=2, pad_id=PAD, pad_to_multiple_of=4)
    lengths = [s["input_ids"].numel() for s in samples]
    assert batch["input_ids"].shape[1] == 4 * -(-max(lengths) // 4)
    assert torch.equal(batch["image_grid_thw"], torch.tensor([[1, 4, 4], [1, 4, 8], [2, 4, 6], [1, 2, 2]]))
    expected, valid = rope_index(batch["input_ids"], batch["image_grid_thw"], lengths)
    assert torch.equal(batch["position_ids"][valid], expected[valid])
    for row, sample in enumerate(samples):  # mrope_positions itself, sample by sample
        is_image = (sample["input_ids"] == IMAGE).tolist()
        grids = sample["image_grid_thw"].tolist() if "image_grid_thw" in sample else []
        assert torch.equal(mrope_positions(is_image, grids, 2).T, expected[row, : lengths[row]])
    # padding keeps counting on all three axes after the sample's largest position
    first_pad = batch["position_ids"][0, lengths[0]]
    assert torch.equal(first_pad, batch["position_ids"][0, : lengths[0]].max().expand(3) + 1)

    # the digits dataset itself: understanding and generation samples of held-out images
    real = [digits[i] for i in range(6)]
    batch = collate_qwen2_vl(real, digits.image_token_id, digits.merge, digits.pad_id)
    lengths = [s["input_ids"].numel() for s in real]
    expected, valid = rope_index(batch["input_ids"], batch["image_grid_thw"], lengths, digits.image_token_id)
    assert torch.equal(batch["position_ids"][valid], expected[valid])


def test_collate_places_image_features_by_global_index():
    samples = [image_sample([(1, 4, 4)], [2, 1]), text_sample(5), image_sample([(1, 4, 8)], [1, 1], seed=5)]
    batch = collate_qwen2_vl(samples, IMAGE, merge=2, pad_id=PAD)
    index = batch["image_feature_index"]
    placeholders = batch["input_ids"] == IMAGE
    assert torch.equal(index[placeholders], torch.arange(4 + 8))
    assert (index[~placeholders] == -1).all()
    assert batch["pixel_values"].shape == (16 + 32, 4)


def test_a_later_sp_shard_embeds_its_image_tokens_by_global_index():
    """Images after a long text run land in sp rank 1's shard: its embeddings equal that slice of the full sequence's,
    image features included, and its positions are the full sequence's (so rotary embeddings match too)."""
    from veomni_lite.distributed.sequence_parallel import slice_micro_batch

    samples = [image_sample([(1, 4, 4)], [20, 1]), image_sample([(1, 4, 4), (1, 4, 4)], [18, 1, 1], seed=3)]
    batch = collate_qwen2_vl(samples, IMAGE, merge=2, pad_id=PAD)
    model = make_vl()
    with torch.no_grad():
        full = model.embed(
            batch["input_ids"], batch["image_feature_index"], batch["pixel_values"], batch["image_grid_thw"]
        )[0]
        shard = slice_micro_batch(batch, sp_rank=1, sp_size=2, pad_id=PAD)
        start = shard["input_ids"].shape[1]
        assert (shard["input_ids"] == IMAGE).sum() == 12, "every image token sits in the second half"
        local = model.embed(
            shard["input_ids"], shard["image_feature_index"], batch["pixel_values"], batch["image_grid_thw"]
        )[0]
    assert full.shape[1] == 2 * start, "no SP padding: the shard is exactly the second half"
    assert torch.equal(local, full[:, start:])
    assert torch.equal(shard["position_ids"], batch["position_ids"][:, start:])


def test_causal_lm_loss_without_targets_is_exact_zero_with_zero_gradient():
    model = make_lm()
    input_ids = torch.randint(0, VOCAB, (2, 7))
    positions = torch.arange(7).expand(2, 7)
    loss = model(input_ids=input_ids, position_ids=positions, labels=torch.full_like(input_ids, IGNORE_INDEX))[
        "foundation_loss"
    ]
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() and not g.any() for g in grads)

    model.zero_grad()
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[0, 2] = 5
    loss = model(input_ids=input_ids, position_ids=positions, labels=labels)["foundation_loss"]
    assert loss.item() > 0
    loss.backward()
    assert any(p.grad.any() for p in model.parameters())


def vl_batch(samples):
    return collate_qwen2_vl(samples, IMAGE, merge=2, pad_id=PAD)


def test_vl_heads_without_targets_are_exact_zero_with_zero_gradient():
    model = make_vl()
    # understanding only: no image codes to predict
    batch = vl_batch([image_sample([(1, 4, 4)], [2, 3]), image_sample([(1, 4, 4)], [1, 1], seed=7)])
    out = model(**batch)
    assert out["image_decoder_loss"].item() == 0.0 and out["foundation_loss"].item() > 0
    out["image_decoder_loss"].backward()
    head = list(model.image_head.parameters())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() and not p.grad.any() for p in head)
    assert all(p.grad is None or (torch.isfinite(p.grad).all() and not p.grad.any()) for p in model.parameters())

    # no text targets at all (e.g. a sequence shard that holds only image codes)
    model.zero_grad()
    batch = vl_batch([text_sample(8)])
    batch["labels"].fill_(IGNORE_INDEX)
    out = model(**batch)
    assert out["foundation_loss"].item() == 0.0 and out["image_decoder_loss"].item() > 0
    out["foundation_loss"].backward()
    lm_head = model.vlm.lm_head.weight.grad
    assert lm_head is not None and torch.isfinite(lm_head).all() and not lm_head.any()
    assert all(p.grad is None or (torch.isfinite(p.grad).all() and not p.grad.any()) for p in model.parameters())


def test_vl_without_images_still_runs_the_vision_tower_with_zero_gradients():
    """Every rank runs the vision tower on every micro-batch (FSDP all-gathers it), contributing exactly 0."""
    model = make_vl()
    batch = vl_batch([text_sample(8), text_sample(5, seed=3)])
    assert "pixel_values" not in batch
    out = model(**batch)
    sum(out.values()).backward()
    visual = list(model.vlm.model.visual.parameters())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() and not p.grad.any() for p in visual)
    assert model.vlm.lm_head.weight.grad.any() and model.image_head[0].weight.grad.any()


@pytest.fixture
def sp_world(monkeypatch):
    """`enable_sequence_parallel` reads the sp group's size only: pretend a group of the given size."""
    sizes = {}

    def world_size(group=None):
        return sizes["sp"]

    monkeypatch.setattr(hf_attention.dist, "get_world_size", world_size)
    yield sizes
    hf_attention.register_ulysses_attention()  # the real function, whatever a test registered


@pytest.mark.parametrize("kind", ["qwen2", "qwen2_vl"])
@pytest.mark.parametrize(
    ("sp", "message"),
    [
        (3, "num_attention_heads (4) is not divisible by sp_size (3)"),
        (4, "num_key_value_heads (2) is not divisible by sp_size (4)"),
    ],
)
def test_enable_sequence_parallel_refuses_heads_it_cannot_split(sp_world, kind, sp, message):
    model = make_lm() if kind == "qwen2" else make_vl()
    text_config = model.config if kind == "qwen2" else model.config.text_config
    sp_world["sp"] = sp
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        model.enable_sequence_parallel(object())
    assert text_config._attn_implementation == "sdpa", "nothing switched before the check"


def test_enable_sequence_parallel_routes_the_decoder_only(sp_world):
    """After enabling, the decoder's attention goes through `veomni_ulysses` (here with no group: plain causal SDPA,
    so the logits must not move) and the vision tower keeps SDPA over whole images."""
    model = make_vl().eval()
    batch = vl_batch([image_sample([(1, 4, 4)], [2, 3]), text_sample(6)])
    inputs = {key: value for key, value in batch.items() if not is_labels_key(key)}
    visual = model.vlm.model.visual
    with torch.no_grad():
        before = model(**inputs)
        vision_before = visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"]).pooler_output

    sp_world["sp"] = 2
    model.enable_sequence_parallel(None)
    assert model.config.text_config._attn_implementation == ATTENTION_NAME
    assert model.config.vision_config._attn_implementation == "sdpa"
    decoder = [layer.self_attn for layer in model.vlm.model.language_model.layers]
    assert all(hasattr(module, "veomni_sp_group") for module in decoder)
    assert not any(hasattr(module, "veomni_sp_group") for module in visual.modules())

    from transformers import AttentionInterface

    calls = []

    def counting(module, *args, **kwargs):
        calls.append(module)
        return ulysses_attention_forward(module, *args, **kwargs)

    AttentionInterface.register(ATTENTION_NAME, counting)
    with torch.no_grad():
        after = model(**inputs)
        vision_after = visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"]).pooler_output
    assert [id(m) for m in calls] == [id(m) for m in decoder], "one call per decoder layer, none in the vision tower"
    assert torch.equal(vision_after, vision_before)
    for key in ("logits", "image_logits"):
        assert (after[key] - before[key]).abs().max().item() <= 1e-6, key


def test_causal_lm_enable_sequence_parallel_switches_its_config(sp_world):
    model = make_lm()
    sp_world["sp"] = 2
    model.enable_sequence_parallel(None)
    assert model.config._attn_implementation == ATTENTION_NAME
    assert all(hasattr(layer.self_attn, "veomni_sp_group") for layer in model.layers)
    assert not dist.is_initialized()
