"""A packed step trains exactly like the same samples unpacked: float64 Qwen2 and Qwen2-VL, every loss mode, packed
(and token-budget) micro-batches at 1 process, DP=2, SP=2 and DP=2 x SP=2, against the one-process unpacked step;
the token-budget layouts give the ranks different micro-batch counts. Negative control: packed rows without their
mask (transformers' plain causal attention) leak across samples at SP=2 and the harness sees it; the one-process
controls (a cache left on, an all-ones mask, 3-row M-RoPE ids) are in `tests/models/test_packing.py`."""

from __future__ import annotations

import time

import pytest

from tests.distributed import packing_fixtures as fx
from tests.distributed.modes_fixtures import MODE_PLANS, SCALE_FACTOR
from tests.models import varlen_reference
from veomni_lite.loss_keys import ATTENTION_SEQUENCE_IDS
from veomni_lite.split_invariance import Layout, _chunks, check_split_invariance
from veomni_lite.utils.loss_utils import LOSS_MODES, LossModes

TEXT_MODES = [LossModes(mode, scale_factor=SCALE_FACTOR) for mode in LOSS_MODES]
VL_MODES = [LossModes(default, {"image_decoder": image}, SCALE_FACTOR) for default, image in MODE_PLANS]
BUDGET = {"text": 24, "vl": 23}
CASES = {
    "text": (fx.build_text, fx.text_samples, fx.collate_text, fx.pack_text, TEXT_MODES),
    "vl": (fx.build_vl, fx.vl_samples, fx.collate_vl, fx.pack_vl, VL_MODES),
}


def layouts(kind: str) -> list[Layout]:
    budget = BUDGET[kind]
    return [
        Layout(1, 1, 2, packed=True),
        Layout(2, 1, 2, packed=True, max_tokens=budget),
        Layout(1, 2, 4, packed=True),
        Layout(2, 2, 2, packed=True, max_tokens=budget),
    ]


@pytest.fixture(scope="module", params=["text", "vl"])
def packed_report(request):
    build, samples, collate, pack, modes = CASES[request.param]
    start = time.monotonic()
    report = check_split_invariance(build, samples(), collate, modes, layouts(request.param), packed_collate=pack)
    print(f"\n{request.param}, packed against unpacked:\n{report}\n({time.monotonic() - start:.0f} s)")
    return request.param, report


@pytest.mark.slow
def test_packed_steps_equal_the_unpacked_step_at_every_layout_and_mode(packed_report):
    kind, report = packed_report
    for key, diff in report.grad_diff.items():
        assert diff < 1e-10 and report.loss_diff[key] < 1e-10, f"{kind} {key}: {diff:.2e}"
    for layout in layouts(kind):
        assert report.collectives_per_step[str(layout)] == (1 if layout.dp * layout.sp > 1 else 0)


def test_the_budget_layouts_give_the_ranks_different_micro_batch_counts():
    for kind, (_, samples, _, _, _) in CASES.items():
        layout = Layout(2, 1, 2, packed=True, max_tokens=BUDGET[kind])
        counts = [sum(1 for chunk in _chunks(layout, samples(), rank) if chunk) for rank in range(2)]
        assert counts[0] != counts[1], (kind, counts)


def _pack_without_mask(samples):
    batch = fx.pack_text(samples)
    del batch[ATTENTION_SEQUENCE_IDS]
    return batch


@pytest.mark.slow
def test_negative_control_packed_rows_without_their_mask_differ():
    report = check_split_invariance(
        fx.build_text, fx.text_samples(), fx.collate_text, ["token-mean"], [Layout(1, 2, 4, packed=True)],
        packed_collate=_pack_without_mask,
    )  # fmt: skip
    print(f"\nnegative control, packed without the mask:\n{report}")
    assert report.worst() > 1e-3


FAMILY_MODES = VL_MODES  # every mode, on both heads
FAMILY_LAYOUTS = [Layout(1, 2, 4), Layout(1, 2, 4, packed=True), Layout(2, 1, 2, packed=True, max_tokens=BUDGET["vl"])]


@pytest.mark.slow
@pytest.mark.parametrize("build", [fx.build_qwen2_5_vl, fx.build_qwen3_vl], ids=["qwen2_5_vl", "qwen3_vl"])
def test_qwen2_5_vl_and_qwen3_vl_packed_and_sp2_equal_the_unpacked_step(build):
    """Qwen2.5-VL (windowed vision blocks) and Qwen3-VL (deepstack, interleaved M-RoPE) through the harness:
    SP=2 unpacked and packed, and DP=2 with token budgets, against one process unpacked, every loss mode on each head.
    Packed under SP the vision towers' gradients differ at 1e-12 (Qwen3-VL) to 2e-9 (Qwen2.5-VL) of the largest
    gradient, the losses at 1e-15: rounding of the masked attention amplified by the tiny random towers (the
    one-process packed step and SP unpacked agree to 1e-16); a leak is 1e-3 and more (the controls)."""
    report = check_split_invariance(build, fx.vl_samples(), fx.collate_vl, FAMILY_MODES, FAMILY_LAYOUTS, fx.pack_vl)
    print(f"\n{build.__name__}, against one process unpacked:\n{report}")
    for (layout, mode), diff in report.grad_diff.items():
        assert diff < (1e-8 if "packed" in layout and "sp2" in layout else 1e-12), (layout, mode, diff)
        assert report.loss_diff[layout, mode] < 1e-12, (layout, mode)
    for layout in FAMILY_LAYOUTS:
        assert report.collectives_per_step[str(layout)] == 1


@pytest.mark.slow
def test_negative_control_qwen3_vl_without_its_deepstack_features_differs():
    """The harness sees a model that drops the deepstack features under SP (so the test above can fail)."""
    report = check_split_invariance(
        fx.build_qwen3_vl_no_deepstack_on_sp, fx.vl_samples(), fx.collate_vl, ["token-mean"], [Layout(1, 2, 4)]
    )
    print(f"\nQwen3-VL dropping deepstack under SP:\n{report}")
    assert report.worst() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize(
    ("build", "samples", "collate", "pack"),
    [
        (fx.build_text_varlen, fx.text_samples, fx.collate_text, fx.pack_text),
        (fx.build_vl_varlen, fx.vl_samples, fx.collate_vl, fx.pack_vl),
    ],
    ids=["text", "vl"],
)
def test_ulysses_around_a_varlen_kernel_gives_the_unpacked_step_and_ignored_boundaries_leak(
    build, samples, collate, pack
):
    """Under SP, Ulysses runs the decoder's flash-style kernel (`VarlenReference`) after the all-to-all, on the whole
    row's host boundaries: SP=2, unpacked and packed, equals one process unpacked. The control, with the text model's
    kernel ignoring them, leaks (so the kernel, not a mask, kept the samples apart)."""
    try:
        sp = [Layout(1, 2, 4), Layout(1, 2, 4, packed=True)]
        report = check_split_invariance(build, samples(), collate, ["token-mean"], sp, pack)
        print(f"\nUlysses around the varlen kernel, packed against unpacked:\n{report}")
        assert report.worst() < 1e-10
        if build is fx.build_text_varlen:
            leaky = check_split_invariance(
                fx.build_text_varlen_leaky, samples(), collate, ["token-mean"], [Layout(1, 2, 4, packed=True)], pack
            )
            print(f"\ncontrol, the kernel ignoring the boundaries:\n{leaky}")
            assert leaky.worst() > 1e-3
    finally:
        varlen_reference.unregister()  # the one-process reference registered it here
