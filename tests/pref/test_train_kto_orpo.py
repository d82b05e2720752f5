"""`trainers/train_preference.py`'s trainer with `pref.loss: kto` (unpaired rows) and `orpo` on gloo: 1 process,
DP=2 and SP=2 (packed, under a token budget) log the same per-step losses and metrics; KTO's step 1 is the policy
at its reference (every d = 0, z0 = 0: the loss is w / 2), then z0 (`kl`) moves, the same on every layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.preference_pairs import help_pairs, write_jsonl
from tests.dist_helpers import run_distributed
from tests.float32_bounds import cancelling_atol
from tests.pref.test_train_preference import LOGPS, RTOL, RTOLS, _ranked, assert_same, by_step, pref_args, train
from veomni_lite.preference.config import PrefConfig

KEYS = {
    "kto": (
        "train/pref_loss",
        "train/grad_norm",
        "train/kl",
        "rewards/chosen",
        "rewards/rejected",
        "logps/chosen",
        "logps/rejected",
        "rewards/margins",
        "logits/chosen",
        "logits/rejected",
    ),  # fmt: skip
    "orpo": (
        "train/pref_loss",
        "train/grad_norm",
        "rewards/margins",
        "train/nll_loss",
        "train/log_odds_ratio",
        "train/log_odds_chosen",
    ),
}


# the mean logit (over the vocabulary, of float32 logits of both signs; -0.0096 at step 2) agrees to about 2e-5 under
# SP; no logged value gives the magnitudes it cancels, so it keeps a relative tolerance (the float64 tests hold 1e-12)
TOLERANCES = {**RTOLS, "logits/chosen": 2e-4, "logits/rejected": 2e-4}


def kto_bounds(reference: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    """Per step, the absolute tolerances of KTO's cancelling metrics (tests/float32_bounds.py): `kl` (z0, the mean of
    pi - ref over the mismatched sides, which re-pair the same completions) cancels two sums of float32
    log-probabilities as large as a completion's |logps|; the rewards are beta (pi - ref); the margin their
    difference."""
    logps = {step: max(abs(reference[key].get(step, 0.0)) for key in LOGPS)
             for step in reference["train/kl"]}  # fmt: skip
    kl = {step: cancelling_atol(2 * value, step) for step, value in logps.items()}
    reward = {step: PrefConfig().beta * bound for step, bound in kl.items()}
    margin = {step: 2 * bound for step, bound in reward.items()}
    return {"train/kl": kl, "rewards/chosen": reward, "rewards/rejected": reward, "rewards/margins": margin}


def rows(loss: str, path: Path) -> Path:
    pairs = help_pairs(16)
    if loss == "orpo":
        return write_jsonl(path, pairs)
    return write_jsonl(path, [{"prompt": r["prompt"], "completion": r["chosen" if i % 3 else "rejected"],
                               "label": bool(i % 3)} for i, r in enumerate(pairs)])  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["kto", "orpo"])
def test_kto_and_orpo_train_alike_on_one_process_dp2_and_sp2_packed(demo, tmp_path, loss):
    data = rows(loss, tmp_path / f"{loss}.jsonl")
    extra = ["--pref.loss", loss, "--optim.lr", "1e-2"]
    if loss == "kto":
        extra += ["--pref.desirable_weight", "1.5", "--pref.undesirable_weight", "0.5"]
    train(pref_args(demo, data, tmp_path / "one", *extra))
    reference = {key: by_step(tmp_path / "one", key) for key in KEYS[loss]}
    assert sorted(reference["train/pref_loss"]) == [1, 2, 3, 4]
    if loss == "kto":  # step 1: the policy is the reference, z0 = 0, each row's loss w (1 - sig(0)) = w / 2
        assert reference["train/kl"][1] == 0.0 and reference["rewards/chosen"][1] == 0.0
        assert max(reference["train/kl"].values()) > 0, reference["train/kl"]
    layouts = {
        "dp2": [],
        # shared prompts off: they change the float32 attention's shapes, so rounding, which these float32 runs' 1e-5
        # would see after 4 steps at lr 1e-2 (test_pref_exact_kto_orpo.py holds 1e-12 in float64 with them)
        "sp2": [
            "--parallel.sp_size",
            "2",
            "--data.packing",
            "true",
            "--data.max_tokens_per_micro_batch",
            "120",
            "--data.shared_prefix",
            "false",
        ],
    }
    bounds = kto_bounds(reference) if loss == "kto" else {}
    for name, more in layouts.items():
        run_distributed(_ranked, 2, pref_args(demo, data, tmp_path / name, *extra, *more), timeout_s=600)
        for key, expected in reference.items():
            tolerance = bounds.get(key, TOLERANCES.get(key, RTOL))
            assert_same(by_step(tmp_path / name, key), expected, f"{loss} {name} {key}", tolerance)


@pytest.mark.slow
def test_kto_precomputed_reference_trains_like_the_live_one_and_evaluates(demo, tmp_path):
    """The precomputed reference holds both sides of each row (completion and mismatched), so the KL pass and the
    loss read it as they read the live one's; evaluation runs its own KL pass (`eval/kl`: 0 on the starting
    weights, where the policy is the reference)."""
    data = rows("kto", tmp_path / "kto.jsonl")
    held = rows("kto", tmp_path / "held.jsonl")
    evaluation = ["--data.eval_path", str(held), "--train.eval_interval", "2", "--train.eval_batches", "1"]
    live = pref_args(demo, data, tmp_path / "live", "--pref.loss", "kto", "--optim.lr", "1e-2", *evaluation)
    train(live)
    train(pref_args(demo, data, tmp_path / "pre", "--pref.loss", "kto", "--optim.lr", "1e-2", *evaluation,
                    "--pref.precompute_reference", "true"))  # fmt: skip
    bounds = kto_bounds({key: by_step(tmp_path / "live", key) for key in ("train/kl", *LOGPS)})
    for key in ("train/pref_loss", "train/kl", "eval/pref_loss", "eval/kl"):
        expected = by_step(tmp_path / "live", key)
        assert expected, key
        assert_same(by_step(tmp_path / "pre", key), expected, f"precomputed {key}", bounds.get(key, RTOL))
    kl = by_step(tmp_path / "live", "eval/kl")
    assert kl[1] == 0.0 and max(kl.values()) > 0, kl
