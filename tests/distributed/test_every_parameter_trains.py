"""Every trainable parameter trains, whatever forward ran before the first step (a DPO reference computed in
`on_model_built`, a live reference swapped in, an evaluation at step 0): for every trainer and option, under FSDP2 on a
real gloo process group, after one step every trainable parameter has changed, its AdamW state exists, the optimizer
holds exactly the model's sharded parameters, and the run checkpoints and resumes to the same values.

Why it is needed: FSDP2's root keeps its parameters gathered after a forward outside backward, and an optimizer built
then holds those gathered plain tensors (embeddings, final norm, LM head), which never update; the final checkpoint
then fails in DCP (`KeyError` in `_get_optim_state_dict`). Negative controls: with the trainer's `reshard` skipped its
check names those parameters; with the check skipped too, the run reproduces the bug and this file's checks catch it.
A computed precomputed reference trains exactly like the live reference at DP=2, and checkpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from examples.preference_pairs import digit_pairs, help_pairs, implicit, write_jsonl
from tests.dist_helpers import run_distributed
from tests.pref import test_train_preference as pref
from tests.rl import test_train_rl as rl
from tests.trainer.helpers import read_events, train_built
from veomni_lite.config import load_config
from veomni_lite.preference.trainer import PreferenceTrainer
from veomni_lite.rl.trainer import RLTrainer
from veomni_lite.trainer.base import BaseTrainer
from veomni_lite.trainer.sft import SFTTrainer

REPO = Path(__file__).resolve().parents[2]
LORA = ["--model.lora", "{rank: 4, alpha: 8, target_modules: [q_proj, v_proj, down_proj]}"]


def _sft(demo: Path, out: Path, model: str, train: str, config_file: str, *extra: str) -> tuple[type, Any]:
    args = [
        "--model.pretrained_dir", str(demo / "models" / model), "--data.train_path", str(demo / train),
        "--train.output_dir", str(out), "--train.micro_batch_size", "2", "--train.global_batch_size", "4",
        "--train.eval_interval", "0", "--logging.log_interval", "1", "--logging.progress_bar", "false",
        "--logging.tensorboard", "false", "--logging.plot", "false", "--optim.warmup_steps", "0", *extra,
    ]  # fmt: skip
    path = REPO / "configs" / config_file
    return SFTTrainer, lambda world, *more: load_config(path, [*args, *more], world_size=world)


def case_builder(case: str, demo: Path, inputs: dict[str, Path], out: Path) -> tuple[type, Any]:
    """(trainer class, `config(world, *more args)`) of one case of the matrix."""
    if case.startswith("sft"):
        extra = LORA if case == "sft_lora" else []
        if case == "sft_vl":
            eval_path = ["--data.eval_path", str(demo / "digits/eval.jsonl")]
            return _sft(demo, out, "qwen2_vl_digits", "digits/train.jsonl", "sft_digits.yaml", *eval_path, *extra)
        return _sft(demo, out, "qwen2_help", "help/train.jsonl", "sft_help.yaml", "--data.eval_fraction", "0", *extra)
    if case.startswith("rl"):
        kl = "0.1" if case == "rl_kl" else "0"
        args = rl.rl_args(demo, inputs["rollouts"], out, "--rl.kl_coef", kl)
        return RLTrainer, lambda world, *more: rl.config([*args, *more], world)
    vl_pairs = str(inputs["vl_pairs"])
    extra = {
        # the live reference, and an evaluation of the starting weights before the first step
        "dpo": ["--data.eval_path", str(inputs["pairs"]), "--train.eval_interval", "1", "--train.eval_batches", "1"],
        "dpo_precompute": ["--pref.precompute_reference", "true", "--data.cache_dir", str(out / "cache")],
        "dpo_cached": ["--pref.precompute_reference", "true", "--data.cache_dir", str(out / "cache")],
        "dpo_lora": [*LORA, "--optim.lr", "1e-2"],
        "dpo_vl": ["--model.pretrained_dir", str(demo / "models/qwen2_vl_digits"), "--data.train_path", vl_pairs],
        "rm": ["--pref.loss", "bradley_terry"],
    }[case]
    args = pref.pref_args(demo, inputs["pairs"], out, *extra)
    return PreferenceTrainer, lambda world, *more: pref.config([*args, *more], world)


CASES = ["sft", "sft_lora", "sft_vl", "rl", "rl_kl", "dpo", "dpo_precompute", "dpo_cached", "dpo_lora", "dpo_vl", "rm"]
# Steps before the check: LoRA's B starts at 0, so A's first gradient is exactly 0 (Adam leaves it in place).
STEPS = {"sft_lora": 2, "dpo_lora": 2}


def full_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter's whole value (collective under FSDP: every rank calls it alike)."""
    return {
        name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
        for name, param in model.named_parameters()
        if param.requires_grad
    }


def audit(trainer: BaseTrainer, before: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What this file checks of a trained trainer: the trainable parameters left unchanged, those the optimizer does
    not hold or holds no AdamW state for, and the optimizer's parameters that are not sharded DTensors."""
    held = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    ids = {id(p) for p in held}
    named = [(name, p) for name, p in trainer.model.named_parameters() if p.requires_grad]
    after = full_values(trainer.model)
    return {
        "unchanged": [name for name in before if torch.equal(before[name], after[name])],
        "not_held": [name for name, p in named if id(p) not in ids],
        "no_state": [name for name, p in named if "exp_avg" not in trainer.optimizer.state.get(p, {})],
        "unsharded": sum(not isinstance(p, DTensor) for p in held),
        "held": len(held),
        "trainable": len(named),
        "values": after,
    }


def _trains_and_resumes(rank: int, world: int, case: str, demo: Path, inputs: dict[str, Path], out: Path,
                        skip: tuple[str, ...] = ()) -> dict[str, Any]:  # fmt: skip
    """One case on this rank: `STEPS` steps audited, then a resume to one more step. `skip` names what of the
    trainer's fix to switch off (the negative controls): "reshard", "check"."""
    import veomni_lite.trainer.base as base

    for name in skip:
        setattr(base, {"reshard": "reshard", "check": "check_sharded"}[name], lambda *args, **kwargs: None)
    cls, config = case_builder(case, demo, inputs, out)
    steps = STEPS.get(case, 1)
    computed = []
    if case == "dpo_cached":  # an earlier run computed the reference into the shared cache
        cls(config(world, "--train.output_dir", str(out / "earlier"))).loader.close()
        from veomni_lite.preference.reference_pass import PrecomputedReference

        original = PrecomputedReference.write
        PrecomputedReference.write = lambda *a: computed.append(1) or original(*a)
    try:
        trainer = cls(config(world, "--train.max_steps", str(steps)))
    except RuntimeError as exc:
        return {"error": str(exc)}
    before = full_values(trainer.model)
    report: dict[str, Any] = {"computed": len(computed)}
    try:
        train_built(trainer)
    except KeyError as exc:  # DCP's save of an optimizer holding tensors outside the model (the bug)
        report["checkpoint_error"] = repr(exc)
    report.update(audit(trainer, before))
    report["step"], report["reference"] = trainer.step, getattr(trainer, "reference", None) is not None
    trainer.loader.close()
    if "checkpoint_error" in report:
        return report
    resumed = cls(config(world, "--train.max_steps", str(steps + 1), "--checkpoint.resume", "true"))
    loaded = full_values(resumed.model)
    report["resumed_at"] = resumed.step
    report["resumed_differ"] = [n for n, value in report["values"].items() if not torch.equal(value, loaded[n])]
    report["resumed_state_steps"] = sorted(
        {float(state["step"]) for state in resumed.optimizer.state.values() if "step" in state}
    )
    train_built(resumed)
    report["resumed_step"] = resumed.step
    report["resumed_audit"] = {k: v for k, v in audit(resumed, loaded).items() if k != "values"}
    report["logged"] = sorted({e["step"] for e in read_events(out) if "train/grad_norm" in e})
    del report["values"]
    return report


@pytest.fixture(scope="module")
def inputs(demo: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inputs")
    rows = help_pairs(16)
    return {
        "pairs": write_jsonl(root / "pairs.jsonl", rows[:8] + [implicit(r) for r in rows[8:]]),
        "vl_pairs": write_jsonl(root / "vl.jsonl", digit_pairs(demo / "digits", 8)),
        "rollouts": rl.write_rollouts(root / "rollouts.jsonl"),
    }


def assert_trains_and_resumes(report: dict[str, Any], case: str) -> None:
    steps = STEPS.get(case, 1)
    assert "error" not in report and "checkpoint_error" not in report, (case, report)
    assert report["trainable"] > 0 and report["held"] == report["trainable"], (case, report)
    for key in ("unchanged", "not_held", "no_state"):
        assert report[key] == [], (case, key, report[key])
    assert report["unsharded"] == 0, (case, report)
    assert report["step"] == steps and report["resumed_at"] == steps, (case, report)
    assert report["resumed_differ"] == [] and report["resumed_state_steps"] == [float(steps)], (case, report)
    assert report["resumed_step"] == steps + 1 and report["logged"] == list(range(1, steps + 2)), (case, report)
    audited = report["resumed_audit"]
    assert audited["unchanged"] == audited["not_held"] == audited["no_state"] == [] and audited["unsharded"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_every_trainable_parameter_trains_checkpoints_and_resumes_under_fsdp(case, demo, inputs, tmp_path):
    """One rank on a real process group: FSDP2 over a mesh of one (what `torchrun --nproc_per_node 1` runs)."""
    (report,) = run_distributed(_trains_and_resumes, 1, case, demo, inputs, tmp_path, timeout_s=600)
    assert_trains_and_resumes(report, case)
    assert report["reference"] == (case in ("rl_kl", "dpo", "dpo_lora", "dpo_vl"))
    if case == "dpo_cached":
        assert report["computed"] == 0, "the reference is read from the cache the earlier run wrote"


@pytest.mark.slow
def test_a_computed_precomputed_reference_trains_every_parameter_at_dp2(demo, inputs, tmp_path):
    """The issue's run: the reference computed (not read from a cache) on 2 ranks, before the optimizer is built."""
    for report in run_distributed(_trains_and_resumes, 2, "dpo_precompute", demo, inputs, tmp_path, timeout_s=600):
        assert_trains_and_resumes(report, "dpo_precompute")


# The root module's parameters of the Qwen2 causal LM: what FSDP2 leaves gathered after a forward.
ROOT = ["hf_model.model.embed_tokens.weight", "hf_model.model.norm.weight", "hf_model.lm_head.weight"]


@pytest.mark.slow
def test_skipping_the_reshard_is_caught_and_skipping_the_check_too_is_the_bug(demo, inputs, tmp_path):
    """Negative controls on the computed precomputed reference: without the reshard the trainer's check names the
    root's gathered parameters; without the check too, those never train and the final checkpoint fails in DCP."""
    (caught,) = run_distributed(
        _trains_and_resumes, 1, "dpo_precompute", demo, inputs, tmp_path / "caught", ("reshard",), timeout_s=600
    )
    assert "gathered, unsharded parameter(s)" in caught["error"], caught
    assert all(name in caught["error"] for name in ROOT), caught
    (bug,) = run_distributed(
        _trains_and_resumes, 1, "dpo_precompute", demo, inputs, tmp_path / "bug", ("reshard", "check"), timeout_s=600
    )
    assert sorted(bug["unchanged"]) == sorted(bug["not_held"]) == sorted(ROOT), bug
    assert bug["unsharded"] == len(ROOT) and "KeyError" in bug["checkpoint_error"], bug


def _live_and_precomputed(rank: int, world: int, demo: Path, inputs: dict[str, Path], out: Path) -> dict[str, Any]:
    """The live-reference run and the computed precomputed-reference run, 4 steps with a checkpoint every 2: each
    one's whole trained weights and the checkpoint steps it saved."""
    runs = {}
    for name, extra in (("live", []), ("pre", ["--pref.precompute_reference", "true"])):
        args = pref.pref_args(demo, inputs["pairs"], out / name, "--checkpoint.save_interval", "2", *extra)
        trainer = train_built(PreferenceTrainer(pref.config(args, world)))
        trainer.loader.close()
        saved = [step for step in (2, 4) if trainer.checkpoints.step_dir(step).is_dir()]
        runs[name] = {"values": full_values(trainer.model), "saved": saved}
    return runs


@pytest.mark.slow
def test_a_computed_precomputed_reference_equals_the_live_reference_step_by_step_at_dp2(demo, inputs, tmp_path):
    """DP=2, the reference computed before training (no cache): the same per-step losses, grad norms and metrics as
    the live reference, the same trained weights, and both runs checkpoint."""
    runs = run_distributed(_live_and_precomputed, 2, demo, inputs, tmp_path, timeout_s=600)[0]
    reference = {key: pref.by_step(tmp_path / "live", key) for key in pref.KEYS}
    bounds = pref.tolerances(reference)
    for key, expected in reference.items():
        assert sorted(expected) == [1, 2, 3, 4], key
        pref.assert_same(pref.by_step(tmp_path / "pre", key), expected, key, bounds.get(key, pref.RTOL))
    assert runs["live"]["saved"] == runs["pre"]["saved"] == [2, 4]
    live, pre = runs["live"]["values"], runs["pre"]["values"]
    assert live.keys() == pre.keys()
    for name, value in live.items():
        torch.testing.assert_close(pre[name], value, rtol=1e-5, atol=1e-6, msg=name)
