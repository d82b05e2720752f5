"""Packed rows compute exactly what the same samples compute unpacked (float64, one process), for the Qwen2 causal LM
and Qwen2-VL with images of several samples in one row; negative controls show the comparison catches a leak. On
SDPA the packed row's attention runs per sample: no [S, S] tensor is created (the dense block mask, the control,
creates one)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.models import varlen_reference
from tests.models.test_hf_models import IMAGE, PAD, image_sample, make_lm, make_vl, text_sample
from veomni_lite.data.collator import collate, pack, packed_positions
from veomni_lite.data.packing import padding_micro_batch, plan_micro_batches
from veomni_lite.loss_keys import ATTENTION_SEQUENCE_IDS, IGNORE_INDEX, SEQUENCE_IDS
from veomni_lite.models import hf_attention
from veomni_lite.models.hf_attention import ATTENTION_NAME, packed_segments
from veomni_lite.models.qwen2_vl import collate_qwen2_vl


def text_samples() -> list[dict[str, torch.Tensor]]:
    return [{k: v for k, v in text_sample(n, seed=n).items() if k != "image_decoder_labels"} for n in (7, 3, 12, 5)]


def vl_samples() -> list[dict[str, torch.Tensor]]:
    return [
        image_sample([(1, 4, 4)], [3, 2]),
        text_sample(6, seed=2),
        image_sample([(1, 4, 8), (1, 4, 4)], [1, 2, 3], seed=3),  # two images in one sample
        image_sample([(1, 2, 2)], [0, 4], seed=4),
    ]


def unpacked_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], lengths: list[int]) -> torch.Tensor:
    """Each sample's logits over its own tokens, from a padded batch, concatenated in sample order."""
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels" and "labels" not in k})["logits"]
    return torch.cat([logits[row, :n] for row, n in enumerate(lengths)])


def packed_difference(unpacked: torch.Tensor, packed: torch.Tensor, lengths: list[int]) -> float:
    return float((packed[0, : sum(lengths)] - unpacked).abs().max() / unpacked.abs().max())


def test_packed_text_logits_equal_the_unpacked_and_the_controls_leak():
    model = make_lm().double()
    samples = text_samples()
    lengths = [s["input_ids"].numel() for s in samples]
    reference = unpacked_logits(model, collate(samples, pad_id=PAD), lengths)
    batch = pack(samples, pad_to_multiple_of=8, pad_id=PAD)
    with torch.no_grad():
        ours = model(**{k: v for k, v in batch.items() if k != "labels"})["logits"]
    assert packed_difference(reference, ours, lengths) < 1e-12

    decoder, head = model.hf_model.model, model.hf_model.lm_head
    ids, positions = batch["input_ids"], batch["position_ids"]
    controls: dict[str, Callable[[], torch.Tensor]] = {
        # transformers' own inference from restarting positions turns off once a cache exists
        "cache on, no mask": lambda: decoder(input_ids=ids, position_ids=positions, use_cache=True).last_hidden_state,
        "all-ones mask": lambda: (
            decoder(
                input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=positions, use_cache=False
            ).last_hidden_state
        ),
    }
    for name, hidden in controls.items():
        with torch.no_grad():
            leaked = packed_difference(reference, head(hidden()), lengths)
        print(f"\ntext control {name!r}: relative logit difference {leaked:.3f}")
        assert leaked > 1e-3, name
    assert model.config._attn_implementation == ATTENTION_NAME, "the packed row ran the per-sample attention"
    one_sample = {**batch, ATTENTION_SEQUENCE_IDS: torch.zeros_like(batch[ATTENTION_SEQUENCE_IDS])}
    with torch.no_grad():  # the segments ignored: the whole row one sample
        logits = model(**{k: v for k, v in one_sample.items() if k != "labels"})["logits"]
    assert packed_difference(reference, logits, lengths) > 1e-3


def test_packed_qwen2_vl_with_images_of_several_samples_in_one_row_equals_the_unpacked_and_3_row_ids_leak():
    model = make_vl().double()
    samples = [
        {**s, **({"pixel_values": s["pixel_values"].double()} if "pixel_values" in s else {})} for s in vl_samples()
    ]
    lengths = [s["input_ids"].numel() for s in samples]
    reference = unpacked_logits(model, collate_qwen2_vl(samples, IMAGE, 2, PAD), lengths)
    batch = collate_qwen2_vl(samples, IMAGE, 2, PAD, pad_to_multiple_of=8, packing=True)
    assert batch["input_ids"].shape[0] == 1 and batch["position_ids"].shape[-1] == 4
    assert int((batch["image_feature_index"] >= 0).sum()) == (batch["input_ids"] == IMAGE).sum() == 4 + 8 + 4 + 1
    inputs = {k: v for k, v in batch.items() if "labels" not in k}
    with torch.no_grad():
        ours = model(**inputs)["logits"]
    assert packed_difference(reference, ours, lengths) < 1e-12

    without_mask = {k: v for k, v in inputs.items() if k != ATTENTION_SEQUENCE_IDS}
    controls = {
        "3-row M-RoPE ids, no mask": {**without_mask, "position_ids": batch["position_ids"][..., 1:]},
        "4-row ids, cache on": None,
    }
    for name, control in controls.items():
        with torch.no_grad():
            if control is not None:
                logits = model(**control)["logits"]
            else:
                embeds = model.embed(
                    batch["input_ids"], batch["image_feature_index"], batch["pixel_values"], batch["image_grid_thw"]
                )[0]
                hidden = model.vlm.model.language_model(
                    inputs_embeds=embeds, position_ids=batch["position_ids"].permute(2, 0, 1), use_cache=True
                ).last_hidden_state
                logits = model.vlm.lm_head(hidden)
        leaked = packed_difference(reference, logits, lengths)
        print(f"\nQwen2-VL control {name!r}: relative logit difference {leaked:.3f}")
        assert leaked > 1e-3, name


def packed_causal_mask(sequence_ids: torch.Tensor) -> torch.Tensor:
    """The reference: [B, 1, S, S] bool, query q may attend key k iff k <= q and both hold the same id."""
    length = sequence_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return ((sequence_ids[:, :, None] == sequence_ids[:, None, :]) & causal)[:, None]


def test_the_segments_group_samples_by_length_and_padding_is_a_sample_of_its_own():
    _, ids = packed_positions([2, 3, 2], 9)
    assert ids.tolist() == [0, 0, 1, 1, 1, 2, 2, -1, -1]
    rows = torch.stack([ids, torch.tensor([0] * 4 + [1] * 5)])
    plan = packed_segments(rows, torch.device("cpu"))
    assert all(keys is None and mask is None for _, keys, mask in plan.groups), "no shared prefix: causal alone"
    assert [(index.shape[1], index.tolist()) for index, _, _ in plan.groups] == [
        (2, [[0, 1], [5, 6], [7, 8]]),
        (3, [[2, 3, 4]]),
        (4, [[9, 10, 11, 12]]),
        (5, [[13, 14, 15, 16, 17]]),
    ]
    gathered = torch.cat([index.reshape(-1) for index, _, _ in plan.groups])
    assert torch.equal(gathered[plan.order], torch.arange(18)), "order puts the groups' outputs back in row order"
    with pytest.raises(ValueError, match=r"host attention_sequence_ids \[B, S\]; got shape \[2, 9\] on meta"):
        packed_segments(rows.to("meta"), torch.device("cpu"))


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_segment_attention_equals_sdpa_under_the_dense_block_mask(kv_heads):
    """The per-sample attention against SDPA with the reference mask and expanded key/value heads (rows of different
    packings, float64); with the segments ignored (one sample per row), it differs."""
    g = torch.Generator().manual_seed(0)
    rows = torch.stack([packed_positions([5, 1, 9, 5], 24)[1], packed_positions([12, 3, 7], 24)[1]])
    q = torch.randn(2, 4, 24, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, 24, 8, generator=g, dtype=torch.float64) for _ in range(2))
    expand = 4 // kv_heads
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(expand, 1), v.repeat_interleave(expand, 1), attn_mask=packed_causal_mask(rows)
    ).transpose(1, 2)
    ours = hf_attention.segment_attention(q, k, v, packed_segments(rows, torch.device("cpu")))
    assert ours.shape == (2, 24, 4, 8)
    assert (ours - reference).abs().max() < 1e-14
    ignored = hf_attention.segment_attention(q, k, v, packed_segments(torch.zeros_like(rows), torch.device("cpu")))
    assert (ignored - reference).abs().max() > 1e-3


def test_pack_shifts_each_sample_alone_and_restarts_positions():
    samples = [{"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor([1, 2, 3])},
               {"input_ids": torch.tensor([4, 5]), "labels": torch.tensor([IGNORE_INDEX, 5])}]  # fmt: skip
    batch = pack(samples, pad_to_multiple_of=4, pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0]]
    assert batch["labels"].tolist() == [[2, 3, IGNORE_INDEX, 5, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert batch[SEQUENCE_IDS].tolist() == batch[ATTENTION_SEQUENCE_IDS].tolist() == [[0, 0, 0, 1, 1, -1, -1, -1]]


def test_plan_micro_batches_fits_the_budget_and_keeps_every_sample_once():
    lengths = [9, 3, 7, 2, 5, 5, 1]
    for packing in (True, False):
        plan = plan_micro_batches(lengths, 10, packing)
        assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
        for mb in plan:
            cost = sum(lengths[i] for i in mb) if packing else len(mb) * max(lengths[i] for i in mb)
            assert cost <= 10
    assert len(plan_micro_batches(lengths, 10, True)) == 4  # 37 tokens: first fit decreasing needs ceil(3.7)
    with pytest.raises(ValueError, match="sample 0 has 9 tokens, over data.max_tokens_per_micro_batch=8"):
        plan_micro_batches(lengths, 8, True, where="rank 1, step 3: ")


def test_a_padding_micro_batch_has_no_target_and_counts_zero():
    from veomni_lite.utils.loss_utils import count_loss_token, mark_sequences

    batch = mark_sequences(pack(text_samples()), "seq-mean-token-mean")
    empty = padding_micro_batch(batch)
    assert (empty["labels"] == IGNORE_INDEX).all() and not empty["foundation_seq_starts"].any()
    counts = count_loss_token(empty)
    assert int(counts["foundation_tokens"]) == 0 and int(counts["foundation_sequences"]) == 0
    assert torch.equal(empty["input_ids"], batch["input_ids"]), "the same forward runs"


def test_the_vision_tower_takes_host_boundaries_and_never_reads_the_grid_tensor(monkeypatch):
    """From a host `image_grid_thw` the model hands the tower its boundaries and positions (computed on the host): the
    features equal transformers' own from a grid it must read, and no `.tolist()` / `.item()` touches the grid the
    tower gets (on an accelerator, the device copy)."""
    model = make_vl().double()
    batch = collate_qwen2_vl(vl_samples(), IMAGE, 2, PAD, packing=True)
    pixels, grid = batch["pixel_values"].double(), batch["image_grid_thw"]
    read: list[int] = []
    for name in ("tolist", "item"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original: read.append(id(self)) or _o(self, *a))
    with torch.no_grad():
        inputs = model._vision_inputs(grid, torch.device("cpu"))  # reads the host grid, by design
        read.clear()
        ours = model.vlm.model.visual(pixels, **inputs).pooler_output
        assert id(inputs["grid_thw"]) not in read, "the tower splits by the host boundaries only"
        read.clear()
        theirs = model.vlm.model.visual(pixels, grid_thw=grid).pooler_output
    assert id(grid) in read, "the control: transformers reads the grid itself"
    assert torch.equal(ours, theirs)


def test_the_digits_job_packed_trains_and_evaluates_like_the_padded_one(tmp_path):
    from tests.models.small_hf import train_small
    from tests.trainer.helpers import losses_by_step, read_events

    evals = ["--train.eval_interval", "2", "--train.eval_batches", "1"]
    padded = read_events(train_small("vl", tmp_path / "padded", *evals).output_dir)
    packed = read_events(train_small("vl", tmp_path / "packed", *evals, "--data.packing", "true").output_dir)
    for key in ("train/loss", "train/grad_norm", "eval/loss", "eval/caption_accuracy"):
        want, got = losses_by_step(padded, key), losses_by_step(packed, key)
        assert want and want.keys() == got.keys(), key
        assert all(got[s] == pytest.approx(want[s], rel=1e-5) for s in want), (key, want, got)


@pytest.fixture
def varlen():
    """A `VarlenReference` that the models and transformers' mask code take for flash-attention."""
    yield varlen_reference.register()
    varlen_reference.unregister()


@pytest.mark.parametrize("kind", ["text", "qwen2_vl"])
def test_flash_style_varlen_attention_gets_host_boundaries_and_packed_equals_unpacked(varlen, kind):
    """The varlen path: no mask, the row's boundaries computed on the host (the padding a span of its own, the
    longest span as an int), and packed logits equal the unpacked ones; with the boundaries ignored, they leak."""
    if kind == "text":
        model, samples = make_lm().double(), text_samples()
        reference_batch = collate(samples, pad_id=PAD)
        batch = pack(samples, pad_to_multiple_of=8, pad_id=PAD)
        config = model.config
    else:
        model = make_vl().double()
        samples = [
            {**s, **({"pixel_values": s["pixel_values"].double()} if "pixel_values" in s else {})} for s in vl_samples()
        ]
        reference_batch = collate_qwen2_vl(samples, IMAGE, 2, PAD)
        batch = collate_qwen2_vl(samples, IMAGE, 2, PAD, pad_to_multiple_of=8, packing=True)
        config = model.config.text_config
    lengths = [s["input_ids"].numel() for s in samples]
    reference = unpacked_logits(model, reference_batch, lengths)
    config._attn_implementation = varlen_reference.VarlenReference.name
    inputs = {k: v for k, v in batch.items() if "labels" not in k}
    with torch.no_grad():
        ours = model(**inputs)["logits"]
    assert packed_difference(reference, ours, lengths) < 1e-12
    row = batch["input_ids"].shape[1]
    spans = [0, *itertools.accumulate(lengths)] + ([row] if sum(lengths) < row else [])
    assert varlen.calls and all(call == (spans, max(lengths)) for call in varlen.calls), varlen.calls[0]

    varlen.use_boundaries = False
    with torch.no_grad():
        leaked = packed_difference(reference, model(**inputs)["logits"], lengths)
    print(f"\n{kind} varlen control (boundaries ignored): relative logit difference {leaked:.3f}")
    assert leaked > 1e-3


def test_flash_attention_over_a_device_row_is_a_clear_error(varlen):
    model = make_lm()
    model.config._attn_implementation = varlen_reference.VarlenReference.name
    batch = pack(text_samples(), pad_id=PAD)
    with pytest.raises(ValueError, match=r"takes one row's host attention_sequence_ids; got shape \[2, \d+\]"):
        model(**{**batch, ATTENTION_SEQUENCE_IDS: batch[ATTENTION_SEQUENCE_IDS].expand(2, -1)})


@pytest.mark.parametrize(
    ("kind", "attention", "packed"),
    [("text", "sdpa", False), ("text", "varlen", True), ("qwen2_vl", "varlen", True)],
)
def test_the_decoder_computes_no_mask_and_never_reads_the_positions(monkeypatch, varlen, kind, attention, packed):
    """No call of transformers' `find_packed_sequence_indices` (a device read of the position ids, so a host sync
    per forward on an accelerator): the models route the decoder's attention through ours (`route_attention`), for
    which transformers computes no mask. The control, on transformers' own attention, calls it and computes the same
    logits. 'varlen' is `VarlenReference`."""
    from transformers import masking_utils

    from veomni_lite.models import hf_attention

    reads: list[int] = []
    original = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda p: reads.append(1) or original(p))
    if kind == "text":
        model, samples = make_lm().double(), text_samples()
        batch = pack(samples, pad_to_multiple_of=8, pad_id=PAD) if packed else collate(samples, pad_id=PAD)
        config = model.config
    else:
        model = make_vl().double()
        batch = collate_qwen2_vl(vl_samples(), IMAGE, 2, PAD, pad_to_multiple_of=8, packing=True)
        batch["pixel_values"] = batch["pixel_values"].double()
        config = model.config.text_config
    if attention == "varlen":
        config._attn_implementation = varlen_reference.VarlenReference.name
    inputs = {k: v for k, v in batch.items() if "labels" not in k}
    with torch.no_grad():
        ours = model(**inputs)["logits"]
        assert reads == []
        monkeypatch.setattr(hf_attention, "route_attention", lambda config: None)
        config._attn_implementation = varlen_reference.VarlenReference.name if attention == "varlen" else "sdpa"
        theirs = model(**inputs)["logits"]
    assert reads, "the control: transformers' mask code reads the positions"
    assert (ours - theirs).abs().max() <= 1e-12 * theirs.abs().max()


def test_packing_and_ulysses_refuse_sliding_window_layers():
    """A 4D mask (packing on SDPA) and `veomni_ulysses` would drop the window silently: both are clear errors."""
    from veomni_lite.models.hf_attention import check_packing_attention, enable_ulysses

    config = make_lm().config
    config.layer_types = ["full_attention", "sliding_attention"]
    with pytest.raises(ValueError, match="sliding-window layers need flash-attention"):
        check_packing_attention(config)
    with pytest.raises(ValueError, match="sequence parallel: veomni_ulysses runs full attention"):
        enable_ulysses(config, (), None)
    config._attn_implementation = "flash_attention_2"
    check_packing_attention(config)  # flash-attention applies the window itself


class Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op creates."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.shapes.append(tuple(tensor.shape))
        return out


@pytest.mark.parametrize("dense_mask", [False, True])
def test_a_packed_sdpa_step_creates_no_tensor_of_the_rows_square(dense_mask):
    """Forward and backward of Qwen2 on one 200-token packed row of samples of at most 40 tokens: no tensor created
    has two dims >= 200. The control hands the decoder the dense block mask (the old path): it creates [1, 1, S, S]."""
    model = make_lm().double()
    lengths = [40, 17, 33, 40, 29, 8, 31]
    samples = [{k: v for k, v in text_sample(n, seed=n).items() if k != "image_decoder_labels"} for n in lengths]
    batch = pack(samples, pad_to_multiple_of=200, pad_id=PAD)
    row = batch["input_ids"].shape[1]
    assert row == 200
    with Shapes() as recorder:
        if dense_mask:
            mask = {"full_attention": packed_causal_mask(batch[ATTENTION_SEQUENCE_IDS])}
            hidden = model.hf_model.model(
                input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=mask, use_cache=False
            ).last_hidden_state
            loss = model.hf_model.lm_head(hidden).sum()
        else:
            loss = model(**batch)["foundation_loss"]
        loss.backward()
    square = [shape for shape in recorder.shapes if sum(size >= row for size in shape) >= 2]
    if dense_mask:
        assert (1, 1, row, row) in square
    else:
        assert recorder.shapes and not square, square[:3]
