"""transformers' mixture-of-experts families behind the trainer's contract, in one process on tiny models (float64,
built from configs, nothing downloaded): Qwen3-MoE and Qwen3-VL-MoE (registry entries), Qwen2-MoE, Mixtral, OLMoE and
DeepSeek-V3 (the generic causal-LM path). The wrapper's loss is transformers' own, packed rows equal the unpacked
samples (a control leaks), the experts implementations agree, LoRA leaves the fused experts and the router frozen,
and an export loads with `from_pretrained` to the trained logits."""

from __future__ import annotations

import pytest
import torch

from tests.models.moe_configs import MOE_TYPES, make_moe, token_batch
from tests.models.test_hf_models import IMAGE, PAD, text_sample, vl_config
from tests.models.test_packing import packed_difference, unpacked_logits
from tests.models.test_vl_families import samples as vl_samples
from tests.models.test_vl_families import without_labels
from veomni_lite.data.collator import collate, pack
from veomni_lite.loss_keys import ATTENTION_SEQUENCE_IDS
from veomni_lite.models.lora import LoraError, LoraSettings, apply_lora, lora_modules
from veomni_lite.models.qwen2_vl import collate_qwen2_vl
from veomni_lite.models.registry import CAUSAL_LM, family_of, is_model_type

# the text example's overrides for a tiny Qwen3-MoE (4 experts, top-2)
MOE_RUN = ["--model.arch", "qwen3_moe", "--model.hf.model_type", "qwen3_moe", "--model.hf.head_dim", "8"]
MOE_RUN += ["--model.hf.num_experts", "4", "--model.hf.num_experts_per_tok", "2", "--model.hf.moe_intermediate_size"]
MOE_RUN += ["16"]


def vl_moe_config():
    """The tiny Qwen3-VL config of the VL tests with a mixture of 4 experts (top-2) in every decoder layer."""
    import transformers

    dense = vl_config(family="qwen3_vl").to_dict()
    text = {**dense["text_config"], "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    keep = ("vision_config", "image_token_id", "vision_start_token_id", "vision_end_token_id", "image_decoder_classes")
    return transformers.Qwen3VLMoeConfig(text_config=text, **{key: dense[key] for key in keep})


def make_vl_moe(seed: int = 0):
    """The wrapper around a seeded Qwen3-VL-MoE of `vl_moe_config`, float64 (eager experts: grouped_mm takes no
    float64)."""
    torch.manual_seed(seed)
    config = vl_moe_config()
    model = family_of(config).build(config).double()
    model.vlm.set_experts_implementation("eager")
    return model


def test_the_moe_families_resolve_to_their_entries_or_the_generic_path():
    import transformers

    assert family_of("qwen3_moe").name == "qwen3_moe" and family_of("qwen3_vl_moe").name == "qwen3_vl_moe"
    assert family_of("qwen3_moe").hf_class() is transformers.Qwen3MoeForCausalLM
    assert family_of(vl_moe_config()).hf_class() is transformers.Qwen3VLMoeForConditionalGeneration
    assert family_of("qwen3_moe").wrapper == CAUSAL_LM.wrapper
    for model_type in ("qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"):
        assert family_of(model_type) is CAUSAL_LM and is_model_type(model_type)
    assert is_model_type("qwen3_moe") and is_model_type("qwen3_vl_moe")


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_the_wrapper_s_loss_is_transformers_own(model_type):
    """Our loss on labels shifted once equals the cross-entropy of transformers' own forward's logits against the
    next tokens (float64), and transformers' own loss (it shifts the ids itself, in float32)."""
    model = make_moe(model_type, dtype=torch.float64)
    batch = token_batch(2, 12)
    ids = batch["input_ids"]
    with torch.no_grad():
        ours = model(**batch)["foundation_loss"]
        out = model.hf_model(input_ids=ids, labels=ids)
        reference = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert out.logits.dtype == torch.float64
    assert abs(float(ours - reference)) <= 1e-12 * float(reference)
    assert abs(float(ours - out.loss)) <= 10 * torch.finfo(torch.float32).eps * float(reference)


def text_samples() -> list[dict[str, torch.Tensor]]:
    return [{k: v for k, v in text_sample(n, seed=n).items() if k != "image_decoder_labels"} for n in (7, 3, 12, 5)]


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_a_packed_row_equals_the_unpacked_samples_and_leaks_without_its_boundaries(model_type):
    model = make_moe(model_type, dtype=torch.float64)
    lengths = [s["input_ids"].numel() for s in text_samples()]
    reference = unpacked_logits(model, collate(text_samples(), pad_id=PAD), lengths)
    batch = {k: v for k, v in pack(text_samples(), pad_to_multiple_of=8, pad_id=PAD).items() if k != "labels"}
    with torch.no_grad():
        packed = model(**batch)["logits"]
        one_sample = {**batch, ATTENTION_SEQUENCE_IDS: torch.zeros_like(batch[ATTENTION_SEQUENCE_IDS])}
        leaked = packed_difference(reference, model(**one_sample)["logits"], lengths)
    assert packed_difference(reference, packed, lengths) < 1e-12
    assert leaked > 1e-3


def test_qwen3_vl_moe_computes_what_transformers_computes_row_by_row():
    model = make_vl_moe()
    batch = collate_qwen2_vl(vl_samples(), IMAGE, 2, PAD)
    with torch.no_grad():
        ours = model(**without_labels(batch))["logits"]
        for row, sample in enumerate(vl_samples()):
            ids = sample["input_ids"][None]
            images = {key: sample[key] for key in ("pixel_values", "image_grid_thw") if key in sample}
            theirs = model.vlm(input_ids=ids, mm_token_type_ids=(ids == IMAGE).long(), **images).logits[0]
            assert (ours[row, : ids.shape[1]] - theirs).abs().max() <= 1e-12 * theirs.abs().max(), row


def test_qwen3_vl_moe_packed_rows_equal_the_unpacked_samples():
    model = make_vl_moe()
    lengths = [s["input_ids"].numel() for s in vl_samples()]
    reference = unpacked_logits(model, collate_qwen2_vl(vl_samples(), IMAGE, 2, PAD), lengths)
    batch = without_labels(collate_qwen2_vl(vl_samples(), IMAGE, 2, PAD, pad_to_multiple_of=8, packing=True))
    with torch.no_grad():
        packed = model(**batch)["logits"]
    assert packed_difference(reference, packed, lengths) < 1e-12


def loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch)["foundation_loss"]
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same(first: tuple, second: tuple, tolerance: float, what: str) -> None:
    (loss, grads), (other_loss, other_grads) = first, second
    assert abs(float(other_loss - loss)) <= tolerance * float(loss), what
    assert other_grads.keys() == grads.keys()
    for key, grad in grads.items():
        assert (other_grads[key] - grad).abs().max() <= tolerance * grad.abs().max(), (what, key)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_the_experts_implementations_compute_the_same_loss_and_gradients(model_type):
    """transformers' `experts_implementation` through `HFCausalLM.set_experts_implementation`: batched_mm equals
    eager to float64 rounding; grouped_mm (the default; float32 and below only) equals eager to float32 rounding
    (a few hundred float32 epsilons: sums over 32 and 16 terms, routing weights in float32)."""
    model = make_moe(model_type, dtype=torch.float64)
    batch = token_batch(2, 12)
    eager = loss_and_grads(model, batch)
    model.set_experts_implementation("batched_mm")
    assert model.config._experts_implementation == "batched_mm"
    assert_same(eager, loss_and_grads(model, batch), 1e-12, "batched_mm")

    model = make_moe(model_type)
    assert model.config._experts_implementation == "grouped_mm"
    grouped = loss_and_grads(model, batch)
    model.set_experts_implementation("eager")
    assert_same(loss_and_grads(model, batch), grouped, 500 * torch.finfo(torch.float32).eps, "grouped_mm")
    with pytest.raises(ValueError, match="not supported"):
        model.set_experts_implementation("fastest")


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "deepseek_v3"])
def test_lora_all_linear_adapts_the_linears_and_leaves_the_fused_experts_and_router_frozen(model_type):
    model = make_moe(model_type, dtype=torch.float64)
    base = model(**token_batch())["foundation_loss"].detach()
    targets = apply_lora(model, LoraSettings(4, 8.0, 0.0, ("all-linear",)), seed=3)
    assert targets and not any(".experts." in t or t.endswith(".gate") for t in targets)
    if model_type != "qwen3_moe":  # the shared experts are plain MLPs: adapted
        assert any("shared_expert" in t for t in targets)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name for name in trained)
    for _, module in lora_modules(model):  # a nonzero B: the adapters change the output and get gradients
        torch.nn.init.normal_(module.lora_B.weight, std=0.1)
    loss = model(**token_batch())["foundation_loss"]
    loss.backward()
    assert abs(float(loss.detach() - base)) > 1e-6
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters() if p.requires_grad)
    routed = [p for name, p in model.named_parameters() if ".experts." in name and "shared" not in name]
    assert routed and all(p.grad is None for p in routed)


@pytest.mark.parametrize("entry", ["experts", "gate_up_proj", "mlp.gate"])
def test_lora_naming_the_fused_experts_or_the_router_is_a_clear_error(entry):
    model = make_moe("qwen3_moe")
    message = rf"model\.lora\.target_modules: '{entry}' matches no Linear layer.*stay frozen under LoRA"
    with pytest.raises(LoraError, match=message):
        apply_lora(model, LoraSettings(4, 8.0, 0.0, (entry,)), seed=3)


def test_the_lora_flops_count_the_frozen_experts_at_their_active_share():
    model = make_moe("qwen3_moe")
    full = model.flops_per_token(12)
    apply_lora(model, LoraSettings(4, 8.0, 0.0, ("all-linear",)), seed=3)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    embed = model.hf_model.get_input_embeddings().weight
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad and p is not embed)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # a frozen parameter counts 4 instead of 6, a routed expert's at top_k / num_experts = 2 / 8
    inactive_experts = experts * (1 - 2 / 8)
    assert model.flops_per_token(12) == full - 2 * (frozen - inactive_experts) + 6 * adapters


def test_a_qwen3_moe_run_exports_a_directory_from_pretrained_loads_to_the_trained_logits(tmp_path):
    """Two steps of the text example on a tiny Qwen3-MoE (`model.arch qwen3_moe`), then `veomni_lite.export`:
    `AutoModelForCausalLM.from_pretrained` gives the trained model's logits, and the trainer logged the active FLOPs."""
    import json

    from transformers import AutoModelForCausalLM

    from tests.models.small_hf import train_small
    from veomni_lite.export import export

    trainer = train_small("text", tmp_path / "run", *MOE_RUN)
    trainer.model.cpu()
    step, files = export(tmp_path / "run", tmp_path / "export")
    assert step == 2 and {"config.json", "model.safetensors"} <= set(files)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(exported).__name__ == "Qwen3MoeForCausalLM"
    batch = trainer.collate([trainer.eval_dataset[i] for i in range(2)])
    with torch.no_grad():
        ours = trainer.model.eval()(input_ids=batch["input_ids"], position_ids=batch["position_ids"])["logits"]
        theirs = exported(input_ids=batch["input_ids"]).logits
    assert (ours - theirs).abs().max() <= 1e-6
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    tokens = events[0]["train/tokens"]
    seq = batch["input_ids"].shape[1]
    assert events[0]["train/flops"] == pytest.approx(trainer.model.flops_per_token(seq) * tokens)


@pytest.mark.parametrize("model_type", [*MOE_TYPES, "qwen3_vl_moe"])
def test_save_pretrained_round_trips_through_the_family_s_from_pretrained(model_type, tmp_path):
    """What `veomni_lite.export` writes (the wrapper's `save_pretrained`) loads with the family's transformers class
    to the same parameters (the fused experts written per expert and merged back) and the same logits."""
    model = make_vl_moe() if model_type == "qwen3_vl_moe" else make_moe(model_type, dtype=torch.float64)
    model.save_pretrained(tmp_path)
    family = family_of(model.config)
    loaded = family.hf_class().from_pretrained(tmp_path, dtype=torch.float64)
    hf_model = model.vlm if model_type == "qwen3_vl_moe" else model.hf_model
    assert loaded.state_dict().keys() == hf_model.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in hf_model.state_dict().items())
    if model_type != "qwen3_vl_moe":
        loaded.set_experts_implementation("eager")
        ids = token_batch()["input_ids"]
        with torch.no_grad():
            assert torch.equal(loaded(input_ids=ids).logits, hf_model(input_ids=ids).logits)


# ---------------------------------------------------------------- sharded load of the fused experts


def whole_and_sharded_states(directory) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the directory loaded whole by transformers' `from_pretrained`, read into a model built on the meta device by
    `load_into_shards`): every parameter and buffer."""
    from veomni_lite.models.sharded_load import build_on_meta, load_into_shards

    whole = family_of(build_on_meta(directory).config).load(directory)
    model = build_on_meta(directory)
    model.to_empty(device="cpu")
    load_into_shards(model, directory)
    states = [{**m.state_dict(), **dict(m.named_buffers())} for m in (whole, model)]
    return states[0], states[1]


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_the_fused_experts_load_from_the_per_expert_tensors_transformers_writes(model_type, tmp_path):
    """transformers writes a layer's fused [E, 2I, H] experts as each expert's gate_proj / up_proj / down_proj (or
    Mixtral's w1 / w3 / w2): the directory is `loadable` shard by shard and the read equals transformers' own load;
    a directory that lacks one expert's tensor is not loadable (rank 0 would load it whole)."""
    from safetensors.torch import load_file, save_file

    from veomni_lite.models.sharded_load import build_on_meta, loadable, weight_names

    make_moe(model_type).save_pretrained(tmp_path / "model")
    names = weight_names(tmp_path / "model")
    assert any(".experts.0." in name for name in names) and not any(name.endswith("gate_up_proj") for name in names)
    assert loadable(build_on_meta(tmp_path / "model"), tmp_path / "model")
    whole, sharded = whole_and_sharded_states(tmp_path / "model")
    assert sharded.keys() == whole.keys() and all(torch.equal(sharded[k], whole[k]) for k in whole)

    tensors = load_file(tmp_path / "model" / "model.safetensors")
    dropped = next(name for name in sorted(tensors) if ".experts.1." in name)
    (tmp_path / "gap").mkdir()
    save_file({k: v for k, v in tensors.items() if k != dropped}, tmp_path / "gap" / "model.safetensors")
    (tmp_path / "gap" / "config.json").write_bytes((tmp_path / "model" / "config.json").read_bytes())
    assert not loadable(build_on_meta(tmp_path / "gap"), tmp_path / "gap")


def released_vl_moe(directory, experts: int = 4) -> dict[str, torch.Tensor]:
    """Write a tiny Qwen3-VL-MoE directory in the released layout (no image head; experts stored [E, H, 2I] and
    [E, I, H], 2I != H); returns the model's own tensors."""
    from safetensors.torch import load_file, save_file

    config = vl_moe_config()
    del config.image_decoder_classes  # a released directory: no image head
    config.text_config.moe_intermediate_size = 8  # 2I != H: the layouts differ in shape
    config.text_config.num_experts = experts
    torch.manual_seed(0)
    family_of(config).build(config).save_pretrained(directory)
    tensors = load_file(directory / "model.safetensors")
    released = {k: v.transpose(1, 2).contiguous() if ".experts." in k else v for k, v in tensors.items()}
    assert released["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (experts, 32, 16)
    save_file(released, directory / "model.safetensors", metadata={"format": "pt"})
    return tensors


def test_qwen3_vl_moe_s_released_layout_loads_transposed(tmp_path):
    """Qwen3-VL-MoE releases store the experts as [E, H, 2I] and [E, I, H] (transformers transposes them at load):
    a directory in that layout reads shard by shard into the model's [E, 2I, H] to what `from_pretrained` gives."""
    from veomni_lite.models.sharded_load import build_on_meta, loadable

    tensors = released_vl_moe(tmp_path)
    assert loadable(build_on_meta(tmp_path), tmp_path)
    whole, sharded = whole_and_sharded_states(tmp_path)
    assert all(torch.equal(sharded[k], whole[k]) for k in whole)
    experts = "vlm.model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert torch.equal(whole[experts], tensors["model.language_model.layers.0.mlp.experts.gate_up_proj"])


def _sharded_against_whole(rank: int, world_size: int, directory: str) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from veomni_lite.models.sharded_load import build_on_meta, load_into_shards

    whole = family_of(build_on_meta(directory).config).load(directory)
    model = build_on_meta(directory)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    load_into_shards(model, directory)
    expected = whole.state_dict()
    return {name: float((p.full_tensor() - expected[name]).abs().max()) for name, p in model.state_dict().items()}


@pytest.mark.slow
def test_fsdp2_shards_of_the_fused_experts_read_per_rank_equal_the_whole_load(tmp_path):
    """2 gloo ranks, FSDP2 over the experts dim of 3 experts (2 on rank 0, 1 on rank 1): each reads its own experts'
    tensors into its shard (Qwen3-MoE: per expert; Qwen3-VL-MoE's released layout: its rows of the transposed
    tensors); gathered, every parameter equals transformers' whole load."""
    from tests.dist_helpers import run_distributed

    make_moe("qwen3_moe", num_experts=3).save_pretrained(tmp_path / "qwen3_moe")
    released_vl_moe(tmp_path / "qwen3_vl_moe", experts=3)  # the transposed views, split unevenly too
    for name in ("qwen3_moe", "qwen3_vl_moe"):
        for diffs in run_distributed(_sharded_against_whole, 2, str(tmp_path / name), timeout_s=300):
            assert diffs and all(diff == 0.0 for diff in diffs.values()), (name, diffs)


# ---------------------------------------------------------------- Ulysses SP and packing across processes


@pytest.mark.slow
@pytest.mark.parametrize("build", ["build_qwen3_moe", "build_deepseek_v3"])
def test_sp2_packed_and_dp2_steps_equal_the_one_process_step(build):
    """`check_split_invariance` on gloo: SP=2 (Ulysses) padded and packed, and DP=2, against one process unpacked,
    float64. Routing is per token, so a layout changes nothing but rounding; the routing weights are computed in
    float32 (transformers' softmax), so a float64 rounding difference can move one by a float32 ulp (6e-8): the
    bound is a few of those."""
    from tests.distributed import packing_fixtures as fx
    from tests.models import moe_configs
    from veomni_lite.split_invariance import Layout, check_split_invariance

    layouts = [Layout(1, 2, 4), Layout(1, 2, 4, packed=True), Layout(2, 1, 2)]
    report = check_split_invariance(
        getattr(moe_configs, build), fx.text_samples(), fx.collate_text, ["token-mean"], layouts,
        packed_collate=fx.pack_text,
    )  # fmt: skip
    print(f"\n{build}:\n{report}")
    for key, diff in report.grad_diff.items():
        assert diff < 1e-6 and report.loss_diff[key] < 1e-6, f"{build} {key}: {diff:.2e}"


# ---------------------------------------------------------------- model.experts_implementation


def test_model_experts_implementation_reaches_the_experts_and_bad_values_are_config_errors(tmp_path):
    from examples.qwen2_pydoc_text import PydocLMTrainer
    from tests.models.small_hf import small_config
    from veomni_lite.config import ConfigError

    def build(*args: str) -> PydocLMTrainer:
        trainer = PydocLMTrainer(small_config("text", tmp_path, *args))
        trainer.close()
        return trainer

    trainer = build(*MOE_RUN, "--model.experts_implementation", "eager")
    assert trainer.model.config._experts_implementation == "eager"
    assert build(*MOE_RUN).model.config._experts_implementation == "grouped_mm"  # transformers' default
    with pytest.raises(ConfigError, match=r"model\.experts_implementation 'fastest': .*not supported"):
        build(*MOE_RUN, "--model.experts_implementation", "fastest")
    with pytest.raises(ConfigError, match=r"model\.experts_implementation 'eager': HFCausalLM has no experts"):
        build("--model.experts_implementation", "eager")  # the dense Qwen2
