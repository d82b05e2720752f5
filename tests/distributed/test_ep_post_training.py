"""Expert parallelism under the post-training trainers, 2 gloo ranks, a tiny Qwen3-MoE policy (8 experts, top-2,
float32: the trainers' dtype): at `parallel.ep_size` 2 every logged metric (the trainer's heads with the router's
`router_aux` / `router_z`, `rl/*`, `rewards/*`, `logps/*`, the grad norm) and every parameter after the run equal
ep_size 1's on the same layout:

- GRPO on given rollouts (`rl.rollouts_path`) with routing replay `old` and the KL reference (its weights swapped
  into the expert shards), at DP=2 and at SP=2 (packed; ep 2 = the whole world there); PPO with a value-head critic;
- GRPO generating with the embedded engine (a whole model on each rank, synced from the shards by
  `full_hf_state`), routing replay `rollout` (the engine's recorded experts replayed by the sharded forward);
- DPO (the live reference) and a reward model (`bradley_terry`, the score head on the MoE decoder).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.dist_helpers import run_distributed
from tests.distributed.test_expert_parallel import _full
from tests.models.moe_configs import write_moe_directory
from tests.pref.test_train_preference import pref_args
from tests.rl.test_routing_replay_rl import math_moe, rl_run_args  # noqa: F401 (a fixture)
from tests.rl.test_train_rl import rl_args, write_rollouts
from tests.trainer.helpers import read_events, train_built
from veomni_lite.distributed import expert_parallel
from veomni_lite.distributed.parallel_state import destroy_parallel_state

EP2 = ("--parallel.ep_size", "2")
SP2 = ("--parallel.sp_size", "2", "--data.packing", "true", "--data.shared_prefix", "false",
       "--data.max_tokens_per_micro_batch", "40")  # fmt: skip
ROUTER = ("--moe.aux_loss_coef", "0.01", "--moe.z_loss_coef", "0.001")  # both router heads train (RL's aux is 0)
# what a run logs that is not the model's arithmetic
UNTIMED = ("_s", "_mb", "tflops", "mfu")  # seconds, memory, throughput


def _runs(rank: int, world: int, runs: dict[str, tuple[str, list[str]]], broken: str = "") -> dict[str, Any]:
    """Each run (`rl` or `pref` trainer, its arguments) one after the other: rank 0's logged events and every
    rank's whole parameters before and after the run. The run named `broken` runs each row on the next local expert
    (the negative control: ep_size > 1 only)."""
    from veomni_lite.config import load_config
    from veomni_lite.preference.config import PrefConfig
    from veomni_lite.preference.trainer import PreferenceTrainer
    from veomni_lite.rl.config import RLConfig
    from veomni_lite.rl.trainer import RLTrainer

    trainers = {"rl": (RLTrainer, {"rl": RLConfig}), "pref": (PreferenceTrainer, {"pref": PrefConfig})}
    grouped = expert_parallel.grouped_linear
    wrong = lambda x, w, counts, t: grouped(x, w.roll(1, 0), counts, t)  # noqa: E731
    out = {}
    for name, (kind, args) in runs.items():
        cls, sections = trainers[kind]
        expert_parallel.grouped_linear = wrong if name == broken else grouped
        trainer = cls(load_config(None, args, world_size=world, sections=sections))
        try:
            initial = _full(trainer.model)
            train_built(trainer)
            params = _full(trainer.model)
        finally:  # the process group stays with the test's ranks (no `trainer.close()`)
            expert_parallel.grouped_linear = grouped
            trainer.loader.close()
            if getattr(trainer, "engine", None) is not None:
                trainer.engine.close()
        directory = args[args.index("--train.output_dir") + 1]
        out[name] = {"events": read_events(directory) if rank == 0 else None, "params": params, "initial": initial}
        destroy_parallel_state()
    return out


def _metrics(events: list[dict[str, Any]]) -> dict[tuple[int, str], float]:
    return {
        (e["step"], key): float(value)
        for e in events
        for key, value in e.items()
        if key != "step" and isinstance(value, (int, float)) and not key.endswith(UNTIMED)
    }


def assert_runs_equal(ours: dict[str, Any], ref: dict[str, Any], what: str, rel: float = 1e-5) -> float:
    """Every logged metric at every step (rel, or 1e-6 absolute near 0) and every parameter: float32 rounding of
    another reduction order, which AdamW's g / sqrt(v) amplifies where a gradient is tiny (a rarely routed expert's
    entries), so also within 1e-3 of how far the run moved that tensor. Returns the worst relative difference of a
    metric (of those above 1e-6)."""
    want, have = _metrics(ref["events"]), _metrics(ours["events"])
    assert want.keys() == have.keys(), (what, sorted(want.keys() ^ have.keys()))
    wrong = {k: (have[k], v) for k, v in want.items() if have[k] != pytest.approx(v, rel=rel, abs=1e-6)}
    assert not wrong, (what, sorted(wrong.items()))
    worst = max(abs(have[k] - v) / abs(v) for k, v in want.items() if abs(v) > 1e-6)
    for name, value in ref["params"].items():
        diff = float((ours["params"][name] - value).abs().max())
        moved = float((value - ref["initial"][name]).abs().max())
        assert diff <= 1e-6 + rel * float(value.abs().max()) + 1e-3 * moved, (what, name, diff, moved)
    return worst


def _trained(run: dict[str, Any]) -> bool:
    """Whether the run moved its experts (the comparison is not of untouched weights)."""
    return any(float((run["params"][n] - p).abs().max()) > 1e-4 for n, p in run["initial"].items() if "experts" in n)


@pytest.mark.slow
def test_grpo_and_ppo_with_routing_replay_old_and_rollout_at_ep2_equal_ep1(math_moe: Path, tmp_path: Path) -> None:  # noqa: F811
    """Given rollouts (random rewards) with `old` replay and a KL reference (4 steps; DP=2, and SP=2 packed under a
    token budget), and PPO with a value-head critic on the MoE decoder; the embedded engine's generations (the tiny
    policy earns no reward: the KL and router heads train) with `rollout` replay, packed with shared prompts (4
    steps, 2 generations: the second from weights synced out of the expert shards): at ep 2 the same metrics
    (`rl/routing/mismatch` included) and parameters."""
    rollouts = write_rollouts(tmp_path / "rollouts.jsonl", vocab=400)
    critic = '{"value_head": true, "lr": 0.01}'
    PPO = ("--rl.advantage", "gae", "--rl.critic", critic, "--rl.kl_coef", "0")  # noqa: N806
    policy = str(math_moe / "models/qwen3_moe")

    def given(name: str, *extra: str) -> list[str]:
        args = rl_args(math_moe, rollouts, tmp_path / name, "--rl.routing_replay", "old", "--train.max_steps", "4",
                       *ROUTER, *extra)  # fmt: skip
        args[args.index("--model.pretrained_dir") + 1] = policy
        return args

    def generated(name: str, *extra: str) -> list[str]:
        return rl_run_args(math_moe, tmp_path / name, "qwen3_moe", "--rl.routing_replay", "rollout",
                           "--rl.kl_coef", "0.1", "--data.packing", "true", "--train.max_steps", "4", *ROUTER,
                           *extra)  # fmt: skip

    runs = {
        "old_ep1": ("rl", given("old_ep1")),
        "old_ep2": ("rl", given("old_ep2", *EP2)),
        "old_sp2_ep1": ("rl", given("old_sp2_ep1", *SP2)),
        "old_sp2_ep2": ("rl", given("old_sp2_ep2", *SP2, *EP2)),
        "ppo_ep1": ("rl", given("ppo_ep1", *PPO)),
        "ppo_ep2": ("rl", given("ppo_ep2", *PPO, *EP2)),
        "rollout_ep1": ("rl", generated("rollout_ep1")),
        "rollout_ep2": ("rl", generated("rollout_ep2", *EP2)),
    }
    results = run_distributed(_runs, 2, runs, timeout_s=900)[0]
    for replay in ("old", "old_sp2", "ppo", "rollout"):
        ep1, ep2 = results[f"{replay}_ep1"], results[f"{replay}_ep2"]
        assert any(key == "rl/routing/mismatch" for _, key in _metrics(ep1["events"])), replay
        print(f"RL {replay}: ep 2 against ep 1, worst relative metric difference "
              f"{assert_runs_equal(ep2, ep1, replay):.1e}")  # fmt: skip
        assert _trained(ep1), replay


@pytest.mark.slow
def test_dpo_and_a_reward_model_at_ep2_equal_ep1_and_a_wrong_dispatch_does_not(demo: Path, tmp_path: Path) -> None:
    from examples.preference_pairs import help_pairs, implicit, write_jsonl
    from tests.pref.test_reward_model import RM

    rows = help_pairs(16)
    pairs = write_jsonl(tmp_path / "pairs.jsonl", rows[:8] + [implicit(r) for r in rows[8:]])
    write_moe_directory(demo / "models/qwen2_help", tmp_path / "qwen3_moe")

    def args(name: str, *extra: str) -> list[str]:
        args = pref_args(demo, pairs, tmp_path / name, *ROUTER, *extra)
        args[args.index("--model.pretrained_dir") + 1] = str(tmp_path / "qwen3_moe")
        return args

    runs = {
        "dpo_ep1": ("pref", args("dpo_ep1")),
        "dpo_ep2": ("pref", args("dpo_ep2", *EP2)),
        "rm_ep1": ("pref", args("rm_ep1", *RM)),
        "rm_ep2": ("pref", args("rm_ep2", *RM, *EP2)),
        "wrong_ep2": ("pref", args("wrong_ep2", *EP2)),
    }
    results = run_distributed(_runs, 2, runs, "wrong_ep2", timeout_s=900)[0]
    for loss in ("dpo", "rm"):
        worst = assert_runs_equal(results[f"{loss}_ep2"], results[f"{loss}_ep1"], loss)
        print(f"{loss}: ep 2 against ep 1, worst relative metric difference {worst:.1e}")
        assert _trained(results[f"{loss}_ep1"]), loss
    with pytest.raises(AssertionError, match="wrong dispatch"):
        assert_runs_equal(results["wrong_ep2"], results["dpo_ep1"], "wrong dispatch")
