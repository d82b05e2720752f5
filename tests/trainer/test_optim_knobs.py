"""The knobs real runs set: AdamW's betas, eps and kernels, the LR schedules, warmup as a ratio, `train.epochs`, and
the SFT entry point's own defaults (the shipped configs keep training exactly as before)."""

from __future__ import annotations

import logging
import math
import runpy

import pytest
import torch

from examples.text_trainer import TextTrainer
from tests.dist_helpers import run_distributed
from tests.trainer.helpers import REPO, losses_by_step, ranked_run, run_trainer, tiny_config
from veomni_lite.config import ConfigError, load_config, replace, validate
from veomni_lite.trainer import launch
from veomni_lite.trainer.base import build_scheduler
from veomni_lite.trainer.lr_schedule import constant, cosine, linear, lr_lambda, ratio_steps, wsd
from veomni_lite.trainer.sft import SFT_DEFAULTS

# ---------------------------------------------------------------- schedules, by hand

W, N, MIN = 4, 20, 0.1  # warmup 4 steps of a 20-step run; the last warmup index is 3, the first after it 4


def test_cosine_at_its_boundaries():
    assert cosine(0, W, N, MIN) == pytest.approx(0.25)  # step 1 trains with lr x 1/4
    assert cosine(3, W, N, MIN) == pytest.approx(1.0)  # the last warmup step trains at the peak
    assert cosine(4, W, N, MIN) == pytest.approx(1.0)  # the decay starts at the peak
    assert cosine(12, W, N, MIN) == pytest.approx(0.55)  # half-way through 16 decay steps: 0.1 + 0.9 / 2
    last = 0.1 + 0.9 * 0.5 * (1 - 0.9807852804032304)  # cos(15 pi / 16) = -cos(pi / 16)
    assert cosine(19, W, N, MIN) == pytest.approx(last)
    assert cosine(20, W, N, MIN) == pytest.approx(MIN)  # the rate after the last step


def test_linear_at_its_boundaries():
    assert linear(0, W, N, MIN) == pytest.approx(0.25)
    assert linear(3, W, N, MIN) == pytest.approx(1.0)
    assert linear(4, W, N, MIN) == pytest.approx(1.0)
    assert linear(12, W, N, MIN) == pytest.approx(0.55)
    assert linear(19, W, N, MIN) == pytest.approx(1 - 0.9 * 15 / 16)  # 0.15625
    assert linear(20, W, N, MIN) == pytest.approx(MIN)


def test_constant_at_its_boundaries():
    assert [constant(i, W, N, MIN) for i in (0, 1, 3, 4, 19)] == pytest.approx([0.25, 0.5, 1.0, 1.0, 1.0])


def test_wsd_at_its_boundaries():
    """5 decay steps of 20: stable at the peak through index 15, then 1 - 0.9 x (i - 15) / 5."""
    values = {i: wsd(i, W, N, MIN, decay_steps=5) for i in (0, 3, 4, 14, 15, 16, 19, 20)}
    assert values == pytest.approx({0: 0.25, 3: 1.0, 4: 1.0, 14: 1.0, 15: 1.0, 16: 0.82, 19: 0.28, 20: MIN})


def test_wsd_decay_never_cuts_into_the_warmup_and_no_warmup_starts_at_the_peak():
    assert [wsd(i, 4, 6, MIN, decay_steps=5) for i in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 0.55])
    for shape in (cosine, linear, constant):
        assert shape(0, 0, N, MIN) == 1.0
    assert wsd(0, 0, N, MIN, decay_steps=0) == 1.0 and wsd(19, 0, N, MIN, decay_steps=0) == 1.0


def test_cosine_is_todays_warmup_cosine_step_for_step():
    def warmup_cosine(warmup_steps, max_steps, min_ratio):  # the schedule every run trained with before
        def factor(step):
            if warmup_steps and step < warmup_steps:
                return (step + 1) / warmup_steps
            progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        return factor

    for warmup, steps in ((20, 400), (10, 100), (0, 7), (30, 10)):
        old, new = warmup_cosine(warmup, steps, 0.1), lr_lambda("cosine", warmup, steps, 0.1)
        assert [new(i) for i in range(steps + 1)] == [old(i) for i in range(steps + 1)]


def test_ratio_steps_is_the_ceiling_without_float_noise():
    assert [ratio_steps(r, n) for r, n in ((0.03, 100), (0.07, 100), (0.03, 50), (0.1, 7), (0.0, 9))] == [3, 7, 2, 1, 0]


def _factors(optim, max_steps: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=optim.lr)
    scheduler = build_scheduler(optimizer, optim, max_steps)
    return [scheduler.lr_lambdas[0](i) for i in range(max_steps)]


def test_warmup_ratio_and_decay_ratio_count_steps_of_the_run():
    config = load_config(
        None, ["--optim.warmup_ratio", "0.1", "--optim.schedule", "wsd", "--optim.decay_ratio", "0.25"]
    )
    assert config.optim.warmup_steps == 0, "the warmup_ratio set replaces warmup_steps' default"
    got = _factors(config.optim, 20)  # warmup 2 steps, decay the last 5
    assert got == pytest.approx([0.5, 1.0] + [1.0] * 13 + [1 - 0.9 * k / 5 for k in range(5)])


def test_a_delayed_group_waits_at_lr_0_then_runs_the_schedule_of_the_shorter_run():
    """`build_scheduler(delays=...)` (PPO's critic warm-up): group 1 trains at 0 for 3 steps, then runs the cosine of
    a 7-step run from its warmup; group 0 runs the 10-step one. Control: no delays is the plain schedule."""
    config = load_config(None, ["--optim.warmup_steps", "2", "--optim.schedule", "cosine"])
    params = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.SGD([{"params": [params[0]]}, {"params": [params[1]]}], lr=1.0)
    scheduler = build_scheduler(optimizer, config.optim, 10, delays=[0, 3])
    whole, shorter = lr_lambda("cosine", 2, 10, 0.1), lr_lambda("cosine", 2, 7, 0.1)
    assert [scheduler.lr_lambdas[0](i) for i in range(10)] == [whole(i) for i in range(10)]
    assert [scheduler.lr_lambdas[1](i) for i in range(10)] == [0.0] * 3 + [shorter(i) for i in range(7)]
    assert optimizer.param_groups[1]["lr"] == 0.0  # the first step already waits
    assert _factors(config.optim, 10) == [whole(i) for i in range(10)]


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--optim.betas", "[0.9]"], r"optim.betas: expected \[beta1, beta2\], each in \[0, 1\), got \[0.9\]"),
        (["--optim.betas", "[0.9, 1.0]"], r"optim.betas: expected \[beta1, beta2\]"),
        (["--optim.betas", "fast"], "optim.betas: expected a list of numbers, got 'fast'"),
        (["--optim.betas", "[0.9, high]"], "optim.betas: expected float, got 'high'"),
        (["--optim.eps", "-1e-8"], "optim.eps: must be >= 0"),
        (["--optim.weight_decay", "-0.1"], "optim.weight_decay: must be >= 0"),
        (["--optim.schedule", "step"], r"optim.schedule: 'step' is not one of \['cosine', 'linear', 'constant', 'wsd'"),
        (["--optim.implementation", "apex"], "optim.implementation: 'apex' is not one of"),
        (["--optim.warmup_ratio", "1.0", "--optim.warmup_steps", "0"], r"optim.warmup_ratio: must be in \[0, 1\)"),
        (["--optim.decay_ratio", "1.5"], r"optim.decay_ratio: must be in \[0, 1\]"),
        (["--optim.min_lr_ratio", "-0.1"], r"optim.min_lr_ratio: must be in \[0, 1\]"),
        (["--train.epochs", "-1"], "train.epochs: must be >= 0"),
        (
            ["--optim.warmup_ratio", "0.1"],  # the YAML sets warmup_steps: 20
            r"optim.warmup_steps \(20, .*vlm_tiny.yaml\) and optim.warmup_ratio \(0.1, command line\) are both set",
        ),
        (
            ["--train.epochs", "2"],  # the YAML sets max_steps: 600
            r"train.max_steps \(600, .*vlm_tiny.yaml\) and train.epochs \(2, command line\) are both set",
        ),
        (["--train.max_steps", "0"], r"train.max_steps: must be >= 1, or train.epochs >= 1"),
    ],
)
def test_bad_knobs_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(REPO / "configs" / "vlm_tiny.yaml", overrides, world_size=1)


def test_betas_eps_and_kernels_parse_from_yaml_and_the_command_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  betas: [0.9, 0.95]\n  eps: 1e-6\n  implementation: fused\n")
    config = load_config(path, world_size=1)
    assert (config.optim.betas, config.optim.eps, config.optim.implementation) == ([0.9, 0.95], 1e-6, "fused")
    config = load_config(path, ["--optim.betas", "[0.8, 1e-3]", "--train.betas", "[0.5, 0.6]"], world_size=1)
    assert config.optim.betas == [0.5, 0.6], "the last setting wins, through the old flat name too"
    config.save(tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml", world_size=1).to_dict() == config.to_dict()


def test_epochs_replace_max_steps_default_and_round_trip(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  epochs: 2\n")
    config = load_config(path, world_size=1)
    assert (config.train.epochs, config.train.max_steps) == (2, 0)
    assert load_config(path, ["--train.max_steps", "0"], world_size=1).train.epochs == 2
    explicit = load_config(REPO / "configs/vlm_tiny.yaml", ["--train.max_steps", "0", "--train.epochs", "1"])
    assert (explicit.train.max_steps, explicit.train.epochs) == (0, 1)
    config.save(tmp_path / "saved.yaml")  # both keys are in the file now, one of them 0
    assert load_config(tmp_path / "saved.yaml", world_size=1).to_dict() == config.to_dict()
    with pytest.raises(ConfigError, match=r"train.max_steps \(5\) and train.epochs \(2\) are both set"):
        validate(replace(config, train={"max_steps": 5}), world_size=1)
    with pytest.raises(ConfigError, match=r"optim.warmup_steps \(3\) and optim.warmup_ratio \(0.1\) are both set"):
        validate(replace(config, optim={"warmup_steps": 3, "warmup_ratio": 0.1}), world_size=1)


def test_sft_defaults_sit_under_the_yaml_and_the_command_line(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text("train:\n  global_batch_size: 32\n")
    sft = load_config(path, world_size=1, defaults=SFT_DEFAULTS)
    assert (sft.optim.lr, sft.optim.schedule, sft.optim.min_lr_ratio) == (1e-5, "cosine", 0.0)
    assert (sft.optim.warmup_ratio, sft.optim.warmup_steps, sft.optim.weight_decay) == (0.03, 0, 0.0)
    assert (sft.train.epochs, sft.train.max_steps, sft.train.global_batch_size) == (3, 0, 32)
    generic = load_config(path, world_size=1)
    assert (generic.optim.lr, generic.optim.warmup_steps, generic.train.max_steps) == (3e-3, 10, 100)
    path.write_text("train:\n  max_steps: 50\noptim:\n  warmup_steps: 5\n")
    mine = load_config(path, ["--optim.lr", "2e-5"], world_size=1, defaults=SFT_DEFAULTS)
    assert (mine.train.max_steps, mine.train.epochs) == (50, 0), "the YAML's max_steps replaces the default epochs"
    assert (mine.optim.warmup_steps, mine.optim.warmup_ratio, mine.optim.lr) == (5, 0.0, 2e-5)


def test_the_sft_entry_point_loads_its_config_with_the_sft_defaults(monkeypatch):
    seen = {}

    def fake_main(trainers, argv=None, defaults=None):
        seen.update(trainers=trainers, defaults=defaults)
        return 0

    monkeypatch.setattr(launch, "main", fake_main)
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(REPO / "trainers" / "train_sft.py"), run_name="__main__")
    assert exited.value.code == 0 and seen["defaults"] is SFT_DEFAULTS


# What each shipped config trained with before these knobs: (lr, warmup_steps, weight_decay, max_steps), cosine to
# 0.1 x lr, betas (0.9, 0.999), eps 1e-8, torch's own AdamW kernels. The SFT configs load under the SFT defaults.
TRAINED_WITH = {
    "text_tiny.yaml": (3e-3, 20, 0.0, 600),
    "vlm_tiny.yaml": (3e-3, 20, 0.0, 600),
    "qwen2_text.yaml": (3e-3, 20, 0.0, 300),
    "qwen2_vl_digits.yaml": (3e-3, 20, 0.0, 400),
    "sft_digits.yaml": (3e-3, 20, 0.0, 400),
    "sft_help.yaml": (3e-3, 20, 0.01, 200),
    "sft_digits_lora.yaml": (3e-3, 10, 0.0, 200),  # written after them, with LoRA's own warmup
}


def test_every_shipped_config_trains_exactly_as_before(tmp_path):
    # own sections and schedules: tests/rl, tests/pref; written after these knobs: the MoE demo
    # (tests/examples/test_moe_demo.py), distillation's and the hub environments' (tests/rl, `make train-envs`)
    post_training = ("rl_", "dpo_", "rm_", "agent_", "ppo_", "moe_", "distill_", "rg_", "verifiers_")
    shipped = [path.name for path in (REPO / "configs").glob("*.yaml") if not path.name.startswith(post_training)]
    assert sorted(TRAINED_WITH) == sorted(shipped)
    (tmp_path / "config.json").write_text('{"num_attention_heads": 4, "num_key_value_heads": 2}')
    model_dir = ["--model.pretrained_dir", str(tmp_path)]  # what `make train-sft` writes first: heads to check
    no_lora = ["--model.lora", "{}"]  # its targets are checked on a whole model directory, which this one is not
    for name, (lr, warmup, weight_decay, steps) in TRAINED_WITH.items():
        sft = name.startswith("sft_")
        args = [*model_dir, *no_lora] if sft else []
        config = load_config(REPO / "configs" / name, args, world_size=2, defaults=SFT_DEFAULTS if sft else None)
        optim = config.optim
        assert (optim.lr, optim.warmup_steps, optim.warmup_ratio, optim.weight_decay) == (lr, warmup, 0.0, weight_decay)
        assert (config.train.max_steps, config.train.epochs, optim.schedule, optim.min_lr_ratio) == (
            steps,
            0,
            "cosine",
            0.1,
        )
        assert (optim.betas, optim.eps, optim.implementation, optim.max_grad_norm) == ([0.9, 0.999], 1e-8, "auto", 1.0)
        expected = lr_lambda("cosine", warmup, steps, 0.1)
        assert _factors(optim, steps) == [expected(i) for i in range(steps)], name


# ---------------------------------------------------------------- AdamW: betas, eps and kernels reach the update


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def _adamw_by_hand(records, betas, eps, weight_decay) -> list[torch.Tensor]:
    """Each step's parameter after a plain AdamW update (decoupled weight decay, bias-corrected moments)."""
    beta1, beta2 = betas
    mean = square = torch.zeros_like(records[0][0])
    expected = []
    for t, (before, grad, lr) in enumerate(records, start=1):
        mean = beta1 * mean + (1 - beta1) * grad
        square = beta2 * square + (1 - beta2) * grad * grad
        step = (mean / (1 - beta1**t)) / ((square / (1 - beta2**t)).sqrt() + eps)
        expected.append(before * (1 - lr * weight_decay) - lr * step)
    return expected


@pytest.mark.parametrize("implementation", ["for_loop", "foreach", "fused"])
def test_betas_and_eps_reach_every_adamw_kernel(tmp_path, implementation):
    optim = {"betas": [0.5, 0.75], "eps": 1e-3, "weight_decay": 0.1, "implementation": implementation, "lr": 1e-2}
    config = replace(tiny_config("text", tmp_path, max_steps=3, warmup_steps=0), optim=optim)
    trainer = TextTrainer(config)
    group = trainer.optimizer.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.5, 0.75), 1e-3, 0.1)
    assert (group["fused"], group["foreach"]) == {"fused": (True, None), "foreach": (None, True)}.get(
        implementation, (False, False)
    )
    param = group["params"][0]  # a weight matrix: it decays
    records, after = [], []
    trainer.optimizer.register_step_pre_hook(
        lambda optimizer, *_: records.append((_full(param), _full(param.grad), optimizer.param_groups[0]["lr"]))
    )
    trainer.optimizer.register_step_post_hook(lambda *_: after.append(_full(param)))
    try:
        trainer.train()
    finally:
        trainer.metrics.close()
    assert len(records) == 3
    for got, expected in zip(after, _adamw_by_hand(records, (0.5, 0.75), 1e-3, 0.1)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    control = _adamw_by_hand(records, (0.9, 0.999), 1e-8, 0.1)  # torch's default betas and eps: not what ran
    assert not torch.allclose(after[-1], control[-1], rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- train.epochs through the real trainer

EPOCHS = {"max_steps": 0, "epochs": 2, "log_interval": 3, "warmup_steps": 2}


def test_epochs_set_the_run_length_the_schedule_and_the_final_log(tmp_path, caplog):
    """43 samples, global batch 8: 5 steps per epoch (3 samples left out of each), 2 epochs = 10 steps; a linear
    decay to 0 over those 10 steps shows the scheduler was built for 10."""
    config = replace(
        tiny_config("text", tmp_path, **EPOCHS),
        data={"num_samples": 43},
        optim={"schedule": "linear", "min_lr_ratio": 0},
    )
    with caplog.at_level(logging.INFO, logger="veomni_lite"):
        events = run_trainer("text", config)
    assert "run: 10 optimizer steps = train.epochs 2 of 5 steps (43 training samples // train.global_batch_size 8; " \
        "3 left out of each epoch); lr 0.003, linear schedule, 2 warmup steps" in caplog.text  # fmt: skip
    assert [e["step"] for e in events] == [3, 6, 9, 10], "the final step is logged: the metrics know the length"
    assert [e["epoch"] for e in events] == [0, 1, 1, 1]
    lrs = {e["step"]: e["train/lr"] for e in events}
    assert lrs == pytest.approx({3: 3e-3, 6: 3e-3 * 5 / 8, 9: 3e-3 * 2 / 8, 10: 3e-3 * 1 / 8})


def test_epochs_resume_to_the_same_end(tmp_path):
    full = run_trainer("text", replace(tiny_config("text", tmp_path / "full", **EPOCHS), data={"num_samples": 43}))
    stopped = replace(tiny_config("text", tmp_path / "resumed", **EPOCHS), data={"num_samples": 43})
    run_trainer("text", stopped, stop_after=4)
    resumed = run_trainer("text", replace(stopped, checkpoint={"resume": True}))
    assert [e["step"] for e in full] == [3, 6, 9, 10] and [e["step"] for e in resumed] == [3, 4, 6, 9, 10]
    for key in ("train/lr", "train/loss"):
        assert resumed[-1][key] == pytest.approx(full[-1][key], rel=1e-6)
    assert resumed[-1]["train/tokens_seen"] == full[-1]["train/tokens_seen"]


def test_a_token_budget_keeps_one_global_batch_per_step(tmp_path):
    """Token-budget micro-batching changes how a step's samples are cut, not how many steps an epoch has."""
    plain = replace(tiny_config("text", tmp_path / "plain", **EPOCHS), data={"num_samples": 43})
    budget = replace(plain, train={"output_dir": str(tmp_path / "budget")}, data={"max_tokens_per_micro_batch": 48})
    cuts = {}
    for name, config in (("plain", plain), ("budget", budget)):
        trainer = TextTrainer(config)
        try:
            steps = [trainer.loader.next_step() for _ in range(trainer.max_steps)]
            assert trainer.max_steps == 10
            assert [sum(len(mb["input_ids"]) for mb in step) for step in steps] == [8] * 10, "8 samples a step"
            cuts[name] = [len(step) for step in steps]
        finally:
            trainer.close()
    assert cuts["plain"] == [4] * 10 and cuts["budget"] != cuts["plain"], "the budget does cut the steps differently"


@pytest.mark.slow
def test_fused_adamw_on_two_sharded_ranks_trains_as_the_one_process_for_loop(tmp_path):
    """The fused kernel over FSDP2's DTensor shards (gloo, CPU) against torch's per-parameter loop on one process."""
    single = tiny_config("text", tmp_path / "one", implementation="for_loop")
    reference = losses_by_step(run_trainer("text", single))
    fused = tiny_config("text", tmp_path / "two", implementation="fused")
    got = run_distributed(ranked_run, 2, "text", fused)[0]
    assert sorted(got) == sorted(reference) == [1, 2, 3, 4]
    assert got == pytest.approx(reference, rel=1e-4)
