"""Every trainer trains an MoE decoder with its router heads: SFT, RL (given rollouts), DPO and a reward model on a tiny
Qwen3-MoE directory (8 experts, top-2, the demo's tokenizer) log `train/router_aux_loss`, `train/router_z_loss` and
`moe/load_imbalance`; the global-batch head's first step is the uniform-f constant k x coefficient; an off-policy RL
step trains with the f of its old-log-probability pass's routing (with and without routing replay)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from examples.preference_pairs import help_pairs, write_jsonl
from tests.pref.test_train_preference import pref_args
from tests.pref.test_train_preference import train as train_preference
from tests.rl.test_train_rl import config as rl_config
from tests.rl.test_train_rl import rl_args, write_rollouts
from tests.rl.test_train_rl import train as train_rl
from tests.trainer.helpers import read_events, train_built
from veomni_lite.config import load_config
from veomni_lite.models.routing import ROUTED_EXPERTS
from veomni_lite.rl.trainer import RLTrainer
from veomni_lite.trainer.sft import SFTTrainer

COEF, TOP_K = 0.001, 2
SHORT = ["--train.max_steps", "2", "--moe.z_loss_coef", "0.001"]


@pytest.fixture(scope="module")
def moe_dir(demo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE `from_pretrained` directory with the demo text model's tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    source, out = demo / "models" / "qwen2_help", tmp_path_factory.mktemp("moe") / "qwen3_moe_help"
    shutil.copytree(
        source, out, ignore=shutil.ignore_patterns("*.safetensors", "config.json", "generation_config.json")
    )
    text = AutoConfig.from_pretrained(source)
    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=text.vocab_size, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_experts=8, num_experts_per_tok=TOP_K, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=512, router_aux_loss_coef=COEF, eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):
                param.normal_(0, 0.5)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def _router_series(out: Path) -> dict[str, dict[int, float]]:
    keys = ("train/router_aux_loss", "train/router_z_loss", "moe/load_imbalance")
    return {key: {e["step"]: e[key] for e in read_events(out) if key in e} for key in keys}


def _check(out: Path, steps: int) -> dict[str, dict[int, float]]:
    series = _router_series(out)
    for key, values in series.items():
        assert sorted(values) == list(range(1, steps + 1)), (key, values)
    assert all(v >= 1.0 for v in series["moe/load_imbalance"].values())
    assert all(v > 0 for v in series["train/router_z_loss"].values())
    return series


def sft_args(demo: Path, moe_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--model.arch", "auto", "--model.pretrained_dir", str(moe_dir),
        "--data.train_path", str(demo / "help/train.jsonl"),
        "--train.micro_batch_size", "2", "--train.global_batch_size", "4", "--train.eval_interval", "0",
        "--data.max_seq_len", "64", "--moe.balance", "global-batch", "--train.output_dir", str(out),
        "--logging.log_interval", "1", "--logging.progress_bar", "false", "--logging.tensorboard", "false",
        "--logging.plot", "false", "--checkpoint.save_interval", "0", "--moe.z_loss_coef", "0.001", *extra,
    ]  # fmt: skip


def train_sft(args: list[str], stop_after: int | None = None) -> SFTTrainer:
    return train_built(SFTTrainer(load_config(Path("configs/sft_help.yaml"), args, world_size=1)), stop_after)


@pytest.mark.slow
def test_a_resumed_global_batch_run_trains_with_the_uninterrupted_runs_f(demo, moe_dir, tmp_path):
    train_sft(sft_args(demo, moe_dir, tmp_path / "whole", "--train.max_steps", "4"))
    train_sft(sft_args(demo, moe_dir, tmp_path / "cut", "--train.max_steps", "4"), stop_after=2)
    train_sft(sft_args(demo, moe_dir, tmp_path / "cut", "--train.max_steps", "4", "--checkpoint.resume", "true"))
    whole, cut = (_router_series(tmp_path / name)["train/router_aux_loss"] for name in ("whole", "cut"))
    assert sorted(cut) == [1, 2, 3, 4]
    for step in (3, 4):
        assert cut[step] == pytest.approx(whole[step], rel=1e-5), (step, cut, whole)
    # a resume without the counts would train step 3 with the uniform f, whose value is exactly k x coef
    assert abs(whole[3] - COEF * TOP_K) > 1e-6


@pytest.mark.slow
def test_sft_trains_the_global_batch_router_head_with_the_previous_steps_f(demo, moe_dir, tmp_path):
    trainer = train_sft(sft_args(demo, moe_dir, tmp_path, "--train.max_steps", "2"))
    series = _check(tmp_path, 2)
    aux = series["train/router_aux_loss"]
    assert aux[1] == pytest.approx(COEF * TOP_K, rel=1e-6)  # step 1: no previous step, uniform f (no gradient)
    assert abs(aux[2] - COEF * TOP_K) > 1e-7  # step 2: step 1's global f
    assert float(trainer.router.global_f.sum()) == pytest.approx(TOP_K)
    # expert_load.jsonl: each logged window's per-layer loads, k slots per routed token of the window
    tokens = {e["step"]: e["train/tokens"] for e in read_events(tmp_path) if "train/tokens" in e}
    rows = [json.loads(line) for line in (tmp_path / "expert_load.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert [sum(layer) for layer in row["loads"]] == [TOP_K * tokens[row["step"]]] * 2
        assert all(value >= 1.0 for value in row["imbalance"])
    assert (tmp_path / "expert_load.png").stat().st_size > 0


@pytest.mark.slow
def test_rl_trains_the_router_heads_beside_the_policy_head(moe_dir, tmp_path):
    rollouts = write_rollouts(tmp_path / "rollouts.jsonl", vocab=1000)
    args = rl_args(Path("unused"), rollouts, tmp_path / "out", *SHORT)
    args[args.index("--model.pretrained_dir") + 1] = str(moe_dir)
    train_rl(args)
    _check(tmp_path / "out", 2)
    assert sorted(_router_series(tmp_path / "out")["train/router_aux_loss"]) == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("replay", ["none", "old"])
def test_an_off_policy_rl_step_trains_with_its_old_pass_routings_global_f(moe_dir, tmp_path, replay):
    rollouts = write_rollouts(tmp_path / "rollouts.jsonl", vocab=1000)
    extra = ("--moe.balance", "global-batch", "--moe.aux_loss_coef", "0.01", "--rl.routing_replay", replay)
    args = rl_args(Path("unused"), rollouts, tmp_path / "out", *SHORT, *extra)  # 2 mini-batches: an old pass
    args[args.index("--model.pretrained_dir") + 1] = str(moe_dir)
    trainer = RLTrainer(rl_config(args))
    steps: list[tuple[bool, torch.Tensor, torch.Tensor]] = []  # (carried experts, f trained with, own forwards' f)
    train_step = trainer.train_step

    def recorded(micro_batches: list[dict[str, torch.Tensor]]) -> None:
        carried = all(ROUTED_EXPERTS in micro_batch for micro_batch in micro_batches)
        train_step(micro_batches)
        own = trainer.router._step_counts.double()  # this step's training forwards' counts (one process)
        steps.append((carried, trainer.router.global_f.clone(), own[:-1] / own[-1]))

    trainer.train_step = recorded
    train_built(trainer)
    assert [carried for carried, _, _ in steps] == [True, True]
    (_, f1, own1), (_, f2, _) = steps
    # step 1 routes the tokens the old pass routed, with its weights: its own f exactly, not the uniform first f
    assert torch.equal(f1, own1)
    assert (f1 - TOP_K / 8).abs().max() > 1e-3
    # step 2 (the second mini-batch): its tokens' old-pass f, not the previous step's f
    assert (f2 - own1).abs().max() > 1e-3
    assert float(f2.sum()) == pytest.approx(TOP_K)


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["sigmoid", "bradley_terry"])
def test_dpo_and_a_reward_model_train_the_router_heads(moe_dir, tmp_path, loss):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", help_pairs(8))
    args = pref_args(Path("unused"), pairs, tmp_path / "out", "--pref.loss", loss, "--moe.balance", "sequence", *SHORT)
    args[args.index("--model.pretrained_dir") + 1] = str(moe_dir)
    train_preference(args)
    _check(tmp_path / "out", 2)
