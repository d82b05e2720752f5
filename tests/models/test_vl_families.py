"""The Qwen VL families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) behind one wrapper, in one process, float64: the wrapper
computes what transformers' own model computes, the collate's positions are each family's `get_rope_index`, packed
rows equal the unpacked samples (with a leaking control), and no forward or backward reads a device tensor: run on
the meta device, where any read raises, with only the model's host inputs on the host (controls: transformers' own
paths raise there)."""

from __future__ import annotations

import types

import pytest
import torch

from tests.models.test_hf_models import (
    IMAGE,
    PAD,
    VL_FAMILIES,
    VOCAB,
    image_sample,
    make_lm,
    make_vl,
    text_sample,
    vl_config,
)
from tests.models.test_packing import packed_difference, unpacked_logits
from veomni_lite.data.collator import collate
from veomni_lite.loss_keys import ATTENTION_SEQUENCE_IDS
from veomni_lite.models.qwen2_vl import QwenVLWithImageHead, collate_qwen2_vl
from veomni_lite.models.registry import family_of


def samples() -> list[dict[str, torch.Tensor]]:
    """Images of 4 and 16 merged patches (Qwen2.5-VL: 1 and 4 windows), two in one sample, a text-only sample."""
    out = [
        image_sample([(1, 8, 8)], [3, 2], seed=1),
        text_sample(7, seed=2),
        image_sample([(1, 4, 8), (1, 4, 4)], [1, 2, 3], seed=3),
        image_sample([(1, 8, 4)], [0, 4], seed=4),
    ]
    return [{**s, **({"pixel_values": s["pixel_values"].double()} if "pixel_values" in s else {})} for s in out]


def without_labels(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value for key, value in batch.items() if "labels" not in key}


@pytest.mark.parametrize("family", VL_FAMILIES)
def test_the_wrapper_computes_what_transformers_computes_row_by_row(family):
    """Every unpadded row's logits equal those of the family's own `...ForConditionalGeneration` forward (its own
    placement, positions, windows, interpolation and deepstack), in one padded micro-batch."""
    model = make_vl(family=family).double()
    assert family_of(model.config).name == family
    batch = collate_qwen2_vl(samples(), IMAGE, 2, PAD)
    with torch.no_grad():
        ours = model(**without_labels(batch))["logits"]
        for row, sample in enumerate(samples()):
            ids = sample["input_ids"][None]
            images = {key: sample[key] for key in ("pixel_values", "image_grid_thw") if key in sample}
            theirs = model.vlm(input_ids=ids, mm_token_type_ids=(ids == IMAGE).long(), **images).logits[0]
            n = ids.shape[1]
            assert (ours[row, :n] - theirs).abs().max() <= 1e-12 * theirs.abs().max(), (family, row)


@pytest.mark.parametrize("family", VL_FAMILIES)
def test_collate_positions_equal_the_familys_get_rope_index(family):
    import transformers

    model_class = {
        "qwen2_vl": transformers.Qwen2VLModel,
        "qwen2_5_vl": transformers.Qwen2_5_VLModel,
        "qwen3_vl": transformers.Qwen3VLModel,
    }[family]
    batch = collate_qwen2_vl(samples(), IMAGE, 2, PAD)
    lengths = [s["input_ids"].numel() for s in samples()]
    valid = torch.arange(batch["input_ids"].shape[1]) < torch.tensor(lengths)[:, None]
    model = model_class.__new__(model_class)  # get_rope_index reads only the config
    model.config = vl_config(family=family)
    ids = batch["input_ids"]
    expected, _ = model.get_rope_index(
        ids, (ids == IMAGE).long(), image_grid_thw=batch["image_grid_thw"], attention_mask=valid.long()
    )
    assert torch.equal(batch["position_ids"][valid], expected.permute(1, 2, 0)[valid])


@pytest.mark.parametrize("family", VL_FAMILIES)
def test_packed_rows_equal_the_unpacked_samples_and_leak_without_their_boundaries(family):
    model = make_vl(family=family).double()
    lengths = [s["input_ids"].numel() for s in samples()]
    reference = unpacked_logits(model, collate_qwen2_vl(samples(), IMAGE, 2, PAD), lengths)
    batch = without_labels(collate_qwen2_vl(samples(), IMAGE, 2, PAD, pad_to_multiple_of=8, packing=True))
    with torch.no_grad():
        packed = model(**batch)["logits"]
        del batch[ATTENTION_SEQUENCE_IDS]  # and the text row of the positions, from which transformers finds them
        batch["position_ids"] = batch["position_ids"][..., 1:]
        leaked = packed_difference(reference, model(**batch)["logits"], lengths)
    assert packed_difference(reference, packed, lengths) < 1e-12
    print(f"\n{family} control (no boundaries): relative logit difference {leaked:.3f}")
    assert leaked > 1e-3


def meta_model_and_batch(family: str, packing: bool) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A model of `family` built on the meta device and a host micro-batch for it (text: three samples)."""
    with torch.device("meta"):
        model = make_lm() if family == "text" else make_vl(family=family)
    if family == "text":
        items = [{k: v for k, v in text_sample(n, seed=n).items() if k != "image_decoder_labels"} for n in (7, 3, 12)]
        return model, collate(items, pad_id=PAD, packing=packing)
    return model, collate_qwen2_vl(samples(), IMAGE, 2, PAD, packing=packing)


def _on_meta(batch: dict[str, torch.Tensor], host: tuple[str, ...]) -> dict[str, torch.Tensor]:
    return {key: value if key in host else value.to("meta") for key, value in batch.items()}


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("family", ["text", *VL_FAMILIES])
def test_no_forward_or_backward_reads_a_device_tensor(family, packing):
    """The model and every input but its `host_inputs` on the meta device: a host read of any of them (`.item()`,
    `.tolist()`, a boolean-mask index, a data-dependent shape) raises, so forward and backward passing means no host
    sync per micro-batch on an accelerator, from the vision towers or the decoders."""
    model, batch = meta_model_and_batch(family, packing)
    losses = model(**_on_meta(batch, model.host_inputs))
    sum(losses.values()).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("family", ["text", VL_FAMILIES[0]])
def test_host_inputs_stay_on_the_host_through_fsdp2s_move_of_the_forward_inputs(family):
    """FSDP2's root pre-forward moves every tensor argument to a CUDA device (`_to_kwargs`; the meta device stands in
    for it here): the trainer's `preforward` hands the model's `host_inputs` over as `HostInput`, which it leaves
    where they are, so the packed forward still reads its boundaries and grids on the host. Control: handed over bare,
    they are moved, and the model refuses them (what the first GPU run met)."""
    from torch.distributed.utils import _to_kwargs

    from veomni_lite.trainer.base import BaseTrainer

    model, batch = meta_model_and_batch(family, packing=True)
    meta = torch.device("meta")
    inputs = BaseTrainer.preforward(types.SimpleNamespace(model=model, device=meta), batch)
    _, (moved,) = _to_kwargs((), inputs, meta, False)
    sum(model(**moved).values()).backward()
    bare = {key: value if key in model.host_inputs else value.to(meta) for key, value in batch.items()}
    _, (moved,) = _to_kwargs((), bare, meta, False)
    with pytest.raises(ValueError, match="on meta"):
        model(**moved)


@pytest.mark.parametrize("family", VL_FAMILIES)
def test_control_transformers_own_vision_tower_reads_the_grid(family):
    with torch.device("meta"):
        model = make_vl(family=family)
    batch = collate_qwen2_vl(samples()[:1], IMAGE, 2, PAD)
    with pytest.raises((RuntimeError, NotImplementedError), match="meta"):
        model.vlm.model.visual(batch["pixel_values"].to("meta"), grid_thw=batch["image_grid_thw"].to("meta"))


@pytest.mark.parametrize("family", ["text", "llama", "qwen3", "mistral", "gemma"])
def test_any_full_attention_decoder_reads_no_position_and_its_own_sdpa_path_does(family):
    """Every full-attention causal LM is routed through our attention, so transformers' mask code never reads the
    position ids (on the meta device, a read raises); the control, the decoder on transformers' own SDPA path,
    reads them (`find_packed_sequence_indices`)."""
    from veomni_lite.models.hf_causal_lm import HFCausalLM, hf_config_from_dict

    settings = {"model_type": "qwen2" if family == "text" else family, "vocab_size": VOCAB, "hidden_size": 32}
    settings |= {"intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    settings |= {"head_dim": 8, "max_position_embeddings": 256}
    with torch.device("meta"):
        model = HFCausalLM.from_config(hf_config_from_dict(settings))
    batch = _on_meta(collate([text_sample(7, seed=1), text_sample(4, seed=2)], pad_id=PAD), model.host_inputs)
    model(**batch)["foundation_loss"].backward()
    model.config._attn_implementation = "sdpa"
    with pytest.raises(RuntimeError, match="meta"):
        model.hf_model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)


@pytest.mark.parametrize("family", VL_FAMILIES)
def test_a_later_sp_shard_places_its_features_and_deepstack_by_global_index(family):
    """Under SP a shard embeds its own tokens: its embeddings (and Qwen3-VL's deepstack features) are the whole
    sequence's, sliced."""
    from veomni_lite.distributed.sequence_parallel import slice_micro_batch

    batch = collate_qwen2_vl(samples(), IMAGE, 2, PAD)
    model = make_vl(family=family).double()
    shard = slice_micro_batch(batch, sp_rank=1, sp_size=2, pad_id=PAD)
    start = shard["input_ids"].shape[1]
    assert (shard["input_ids"] == IMAGE).any()
    with torch.no_grad():
        full = model.embed(
            batch["input_ids"], batch["image_feature_index"], batch["pixel_values"], batch["image_grid_thw"]
        )
        local = model.embed(
            shard["input_ids"], shard["image_feature_index"], batch["pixel_values"], batch["image_grid_thw"]
        )
    width = full[0].shape[1] - start  # the shard may end in SP padding
    assert torch.equal(local[0][:, :width], full[0][:, start:])
    assert (local[1] is None) == (full[1] is None) == (family != "qwen3_vl")
    if full[1] is not None:
        assert all(torch.equal(mine[:, :width], whole[:, start:]) for mine, whole in zip(local[1], full[1]))
        assert full[1][0].abs().sum() > 0


def test_a_family_wrapper_refuses_a_config_of_another_family():
    with pytest.raises(ValueError, match="takes a Qwen VL config; got model_type 'qwen2'"):
        QwenVLWithImageHead(make_lm().config)
