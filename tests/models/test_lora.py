"""LoRA in one process: `model.lora` settings and targets (bad ones a ConfigError naming the key before any process
group), the adapted layer against W x + b + (alpha / r) B A x written by hand, the seeded init, a trainer step
against a hand-written step (autograd through the merged weights W + (alpha / r) B A of the plain transformers
model, clipping and AdamW by hand), and the export: a PEFT adapter directory that `PeftModel.from_pretrained` loads
with the trained logits, and `--merge`'s model directory."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.models.lora_fixtures import REPO, TEXT_LORA, help_args, random_b
from tests.models.test_hf_models import make_lm, make_vl
from veomni_lite.config import ConfigError, load_config
from veomni_lite.models.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LoraError,
    LoraLinear,
    LoraSettings,
    apply_lora,
    lora_modules,
    resolve_targets,
)
from veomni_lite.trainer.sft import SFTTrainer

HELP_YAML = REPO / "configs" / "sft_help.yaml"


# ---------------------------------------------------------------- settings and targets


def test_settings_defaults_and_off():
    assert LoraSettings.parse({}) is None and LoraSettings.parse({"rank": 0}) is None
    settings = LoraSettings.parse({"rank": 8, "target_modules": "q_proj"})
    assert settings == LoraSettings(8, 8.0, 0.0, ("q_proj",)) and settings.scaling == 1.0
    assert LoraSettings.parse({"rank": 4}).target_modules == ("all-linear",)


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ("{rank: 0, target_modules: [q_proj]}", r"model\.lora\.rank: LoRA needs a rank >= 1, got 0"),
        ("{rank: -2}", r"model\.lora\.rank: LoRA needs a rank >= 1, got -2"),
        ("{target_modules: [q_proj]}", r"model\.lora\.rank: LoRA needs a rank >= 1"),
        ("{rank: 4, alpha: 0}", r"model\.lora\.alpha: must be a number > 0"),
        ("{rank: 4, dropout: 1.0}", r"model\.lora\.dropout: must be in \[0, 1\)"),
        ("{rank: 4, target_modules: []}", r"model\.lora\.target_modules: expected module names"),
        ("{rank: 4, targets: [q_proj]}", r"model\.lora: unknown key\(s\) \['targets'\]"),
        ("{rank: 4, target_modules: [q_projj]}", r"model\.lora\.target_modules: 'q_projj' matches no Linear layer"),
        ("{rank: 4, target_modules: [self_attn]}", r"'self_attn' .*it names \['Qwen2Attention'\], not Linear layers"),
        ("{rank: 4, target_modules: [qkv]}", r"'qkv' matches no Linear layer of Qwen2ForCausalLM"),
    ],
)
def test_bad_settings_are_a_config_error_naming_the_key_before_any_process_group(demo, tmp_path, lora, message):
    args = ["--model.pretrained_dir", str(demo / "models/qwen2_help"), "--model.lora", lora]
    with pytest.raises(ConfigError, match=message):
        load_config(HELP_YAML, args, world_size=2)
    assert not dist.is_initialized()


def test_lora_without_a_pretrained_directory_or_on_a_tiny_model_is_a_config_error():
    with pytest.raises(ConfigError, match=r"model\.lora: LoRA adapts a pretrained model.*set model\.pretrained_dir"):
        load_config(REPO / "configs" / "qwen2_text.yaml", ["--model.lora", "{rank: 4}"], world_size=1)
    with pytest.raises(ConfigError, match=r"model\.lora: LoRA adapts a transformers model; model\.arch tiny"):
        load_config(REPO / "configs" / "text_tiny.yaml", ["--model.lora", "{rank: 4}"], world_size=1)


def test_targets_by_name_glob_and_all_linear_leave_out_the_output_head():
    hf = make_lm().hf_model
    assert resolve_targets(hf, ("q_proj", "v_proj")) == [
        f"model.layers.{i}.self_attn.{name}" for i in range(2) for name in ("q_proj", "v_proj")
    ]
    assert resolve_targets(hf, ("layers.1.*_proj",))[0] == "model.layers.1.self_attn.q_proj"
    every = resolve_targets(hf, ("all-linear",))
    assert len(every) == 2 * 7 and "lm_head" not in every
    assert resolve_targets(hf, ("lm_head",)) == ["lm_head"]  # named: allowed


def test_the_vision_tower_is_left_out_unless_an_entry_names_it():
    hf = make_vl().vlm
    tower = [path for path in resolve_targets(hf, ("visual.*",)) if path.startswith("model.visual.")]
    assert tower and all(path.startswith("model.visual.") for path in tower)
    assert not any("visual" in path for path in resolve_targets(hf, ("all-linear",)))
    assert resolve_targets(hf, ("visual.*.qkv",)) == ["model.visual.blocks.0.attn.qkv"]
    with pytest.raises(LoraError, match=r"'fc1' matches no Linear layer.*vision tower \(model\.visual\) only"):
        resolve_targets(hf, ("fc1",))  # only the tower's MLP is named fc1


# ---------------------------------------------------------------- the adapted layer


def test_the_adapted_layer_is_w_x_plus_b_a_x_times_alpha_over_r_and_keeps_the_base_names():
    model = make_lm().double()
    names = set(model.state_dict())
    rng = torch.get_rng_state()
    apply_lora(model, TEXT_LORA, seed=3)
    assert torch.equal(torch.get_rng_state(), rng)  # the adapters draw from their own generator
    random_b(model)
    new = set(model.state_dict()) - names
    assert names <= set(model.state_dict()) and len(new) == 2 * 2 * 4
    assert all(name.endswith((".lora_A.weight", ".lora_B.weight")) for name in new)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == new
    layer = model.hf_model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, LoraLinear) and isinstance(layer, nn.Linear)
    x = torch.randn(3, 5, layer.in_features, dtype=torch.float64)
    w, b, a, bb = layer.weight, layer.bias, layer.lora_A.weight, layer.lora_B.weight
    expected = x @ w.T + b + (x @ a.T @ bb.T) * (8.0 / 4)
    assert torch.allclose(layer(x), expected, atol=1e-12, rtol=0)
    dropped = LoraLinear(nn.Linear(4, 3).double(), rank=2, alpha=2.0, dropout=0.5)
    nn.init.normal_(dropped.lora_A.weight), nn.init.normal_(dropped.lora_B.weight)
    x = torch.randn(64, 4, dtype=torch.float64)
    plain = x @ dropped.weight.T + dropped.bias + x @ dropped.lora_A.weight.T @ dropped.lora_B.weight.T
    assert torch.allclose(dropped.eval()(x), plain) and not torch.allclose(dropped.train()(x), plain)


def test_the_flops_count_no_weight_gradient_for_the_frozen_base():
    model = make_lm()
    full = model.flops_per_token(16)
    apply_lora(model, TEXT_LORA, seed=3)
    embed = model.hf_model.get_input_embeddings().weight
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad and p is not embed)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert model.flops_per_token(16) == full - 2 * frozen + 6 * adapters


def test_the_init_is_seeded_kaiming_uniform_a_and_zero_b_alike_on_every_build():
    first, second, other = make_lm(), make_lm(seed=5), make_lm()
    for model, seed in ((first, 3), (second, 3), (other, 4)):
        apply_lora(model, TEXT_LORA, seed=seed)
    (_, one), (_, two), (_, three) = (lora_modules(m)[0] for m in (first, second, other))
    assert torch.equal(one.lora_A.weight, two.lora_A.weight) and not torch.equal(one.lora_A.weight, three.lora_A.weight)
    bound = 1 / math.sqrt(one.in_features)
    assert one.lora_A.weight.abs().max() <= bound and one.lora_A.weight.abs().max() > 0.9 * bound
    assert not one.lora_B.weight.any() and one.lora_A.weight.dtype == torch.float32


# ---------------------------------------------------------------- a trainer step against a hand-written one


def _hand_step(base_dir: Path, adapters: dict, micro_batches: list, scaling: float, optim: dict) -> dict:
    """Loss, clipped gradients of every (A, B) and the step's AdamW update, in float64, with nothing of ours: the
    plain transformers model run on W + scaling x B A for each adapted W."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float64).eval()
    leaves = {path: [t.double().clone().requires_grad_() for t in ab] for path, ab in adapters.items()}
    weights = {f"{path}.weight": base.get_submodule(path).weight + scaling * b @ a for path, (a, b) in leaves.items()}
    total = sum(int((mb["labels"] != -100).sum()) for mb in micro_batches)
    loss = 0.0
    for mb in micro_batches:
        inputs = {"input_ids": mb["input_ids"], "position_ids": mb["position_ids"]}
        logits = torch.func.functional_call(base, weights, args=(), kwargs=inputs).logits
        loss = loss + nn.functional.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten(), reduction="sum")
    loss = loss / total
    loss.backward()
    grads = {path: [t.grad for t in ab] for path, ab in leaves.items()}
    norm = torch.sqrt(sum((g**2).sum() for ab in grads.values() for g in ab))
    coef = min(1.0, optim["max_grad_norm"] / (float(norm) + 1e-6))
    clipped = {path: [g * coef for g in ab] for path, ab in grads.items()}
    return {"loss": float(loss.detach()), "norm": float(norm), "grads": clipped}


def _adamw_first_step(param: torch.Tensor, grad: torch.Tensor, optim: dict, lr: float) -> torch.Tensor:
    (beta1, beta2), eps, decay = optim["betas"], optim["eps"], optim["weight_decay"]
    m, v = (1 - beta1) * grad, (1 - beta2) * grad * grad
    denom = (v.sqrt() / math.sqrt(1 - beta2)) + eps
    return param * (1 - lr * decay) - (lr / (1 - beta1)) * m / denom


def test_a_lora_trainer_step_equals_the_hand_written_step(demo, tmp_path):
    config = load_config(HELP_YAML, help_args(demo, tmp_path / "run"), world_size=1)
    trainer = SFTTrainer(config)
    try:
        random_b(trainer.model)  # a fresh B is zero, and so would be every gradient of A
        micro_batches = [trainer.shard(mb) for mb in trainer.loader.next_step()]
        assert len(micro_batches) == 4  # GA 4
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        adapters = {p: (m.lora_A.weight.detach(), m.lora_B.weight.detach()) for p, m in lora_modules(trainer.model)}
        optim = {k: getattr(config.optim, k) for k in ("betas", "eps", "weight_decay", "max_grad_norm")}
        hand = _hand_step(demo / "models/qwen2_help", adapters, micro_batches, TEXT_LORA.scaling, optim)
        wrong = _hand_step(demo / "models/qwen2_help", adapters, micro_batches, TEXT_LORA.alpha, optim)
        seen = {}
        step = trainer.optimizer.step

        def recording_step(*args, **kwargs):
            seen.update({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
            return step(*args, **kwargs)

        trainer.optimizer.step = recording_step
        lr = trainer.scheduler.get_last_lr()[0]
        trainer.train_step(micro_batches)
    finally:
        trainer.close()
    prefix = "hf_model."
    names = {path: [f"{prefix}{path}.lora_A.weight", f"{prefix}{path}.lora_B.weight"] for path in adapters}
    assert set(seen) == {name for pair in names.values() for name in pair}  # no gradient on the frozen base
    scale = max(float(g.abs().max()) for ab in hand["grads"].values() for g in ab)
    diff = max(float((seen[n] - g).abs().max()) for p, ab in hand["grads"].items() for n, g in zip(names[p], ab))
    wrong_diff = max(float((seen[n] - g).abs().max()) for p, ab in wrong["grads"].items() for n, g in zip(names[p], ab))
    print(f"\nLoRA step: largest gradient difference {diff / scale:.1e} of the largest gradient; alpha/r = alpha "
          f"instead: {wrong_diff / scale:.1e}; grad norm {hand['norm']:.4f} (clipped)")  # fmt: skip
    assert diff / scale < 1e-5 and wrong_diff / scale > 1e-2
    after = dict(trainer.model.named_parameters())
    for name, value in before.items():
        if name in seen:
            expected = _adamw_first_step(value, seen[name], optim, lr)
            assert torch.allclose(after[name].detach(), expected, atol=1e-7, rtol=0), name
        else:
            assert torch.equal(after[name].detach(), value), name  # the base did not move
    state = trainer.optimizer.state
    assert len(state) == len(seen) and all(p.requires_grad for p in state)


# ---------------------------------------------------------------- export


@pytest.fixture(scope="module")
def text_run(demo, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_text_run")
    trainer = SFTTrainer(load_config(HELP_YAML, help_args(demo, root / "run"), world_size=1))
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer, root


def test_the_checkpoint_holds_the_adapters_and_their_optimizer_state_only(text_run):
    from veomni_lite.trainer.safe_load import load_dcp_metadata

    _, root = text_run
    metadata = load_dcp_metadata(root / "run/checkpoints/step_00000003/.metadata")
    model_keys = {k for k in metadata.state_dict_metadata if k.startswith("model.")}
    optim_keys = {k for k in metadata.state_dict_metadata if k.startswith("optim.state.")}
    assert len(model_keys) == 2 * 2 * 4 and all(".lora_" in key for key in model_keys)
    assert optim_keys and all(".lora_" in key for key in optim_keys)


def test_the_adapter_directory_loads_in_peft_with_the_trained_logits_and_merge_gives_them_too(demo, text_run):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from veomni_lite.export import main

    trainer, root = text_run
    base = demo / "models/qwen2_help"
    assert main([str(root / "run"), str(root / "adapter")]) == 0
    assert main([str(root / "run"), str(root / "merged"), "--merge"]) == 0
    config = json.loads((root / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == str(base.resolve()) and config["r"] == 4 and config["lora_alpha"] == 8
    assert sorted(config["target_modules"]) == ["down_proj", "k_proj", "q_proj", "v_proj"]
    with safe_open(str(root / "adapter" / ADAPTER_WEIGHTS), framework="pt") as handle:
        keys = set(handle.keys())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys and len(keys) == 16
    assert not (root / "adapter" / "model.safetensors").exists()
    batch = trainer.collate([trainer.train_dataset[i] for i in range(4)])
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(root / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(str(root / "merged")).eval()
    plain = AutoModelForCausalLM.from_pretrained(str(base)).eval()
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    with torch.no_grad():
        ours = trainer.model.eval()(**inputs)["logits"]
        theirs, merged_logits, base_logits = (m(**inputs).logits for m in (peft_model.eval(), merged, plain))
    diffs = {name: float((ours - logits).abs().max()) for name, logits in
             (("PEFT", theirs), ("merged", merged_logits), ("base alone", base_logits))}  # fmt: skip
    print(f"\nexport: largest logit difference from the trained model: {diffs}")
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5)
    assert torch.allclose(ours, merged_logits, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours, base_logits, atol=1e-4)  # the adapters changed something
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (root / "merged").iterdir()}


@pytest.mark.parametrize("lora", ["{rank: 4, target_modules: [q_proj]}", "{}"])
def test_resuming_with_other_lora_settings_is_an_error_naming_them(demo, text_run, tmp_path, lora):
    import shutil

    from veomni_lite.trainer.checkpoint import CheckpointError

    _, root = text_run
    shutil.copytree(root / "run/checkpoints", tmp_path / "run/checkpoints")
    args = help_args(demo, tmp_path / "run", "--checkpoint.resume", "true", "--model.lora", lora)
    with pytest.raises(CheckpointError, match=r"does not fit this model.*settings that differ: model\.lora: "):
        SFTTrainer(load_config(HELP_YAML, args, world_size=1))


def test_a_run_without_lora_removes_an_earlier_runs_adapter_config(tmp_path):
    from veomni_lite.models.lora import write_adapter_config

    model = make_lm()
    apply_lora(model, TEXT_LORA, seed=0)
    write_adapter_config(model, TEXT_LORA, tmp_path / "base", tmp_path)
    assert json.loads((tmp_path / ADAPTER_CONFIG).read_text())["target_modules"] == [
        "down_proj",
        "k_proj",
        "q_proj",
        "v_proj",
    ]
    write_adapter_config(make_lm(), None, "", tmp_path)
    assert not (tmp_path / ADAPTER_CONFIG).exists()


def test_merge_of_a_run_without_lora_is_an_error(tmp_path):
    from veomni_lite.export import export

    (tmp_path / "run/model_config").mkdir(parents=True)
    make_lm().save_config(tmp_path / "run/model_config")
    with pytest.raises(ValueError, match=r"--merge: .* is not a LoRA run"):
        export(tmp_path / "run", tmp_path / "out", merge=True)
