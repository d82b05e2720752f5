"""Routing replay through the RL pipeline (`rl.routing_replay`), on a float64 tiny Qwen3-MoE, one process:

- the embedded engine records the experts each prompt and response token was routed to while generating (shared
  prefill or not): exactly a plain forward's routing of the same tokens;
- `collate_rollouts` lays each sample's experts out at its tokens' positions (padded, packed with shared prefixes,
  SP-sliced), and the old pass reads them back per sample;
- `old`: the old pass (`logprob_pass.fill`) records each sample's experts; the trainer's forward (`RLTrainer.forward`)
  hands the experts modules exactly those, reproduces the old log-probabilities bit for bit with the same weights
  (`rl/routing/mismatch` 0), and after a router update still routes as the old pass did (the mismatch metric counts
  the decisions it replayed) while the router gets a gradient; without replay the routing moves and the log-probs
  with it, further from the old pass's than with replay;
- `rollout`: the trainer's log-probs under the generation's experts equal the engine's; with an engine whose router
  differs (another precision, say), replay brings the trainer's log-probs closer to the engine's than no replay.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.models.moe_configs import VOCAB, make_moe, write_moe_directory
from tests.models.test_routing_replay import experts_see
from tests.trainer.helpers import read_events, train_built
from veomni_lite.config import ConfigError, load_config
from veomni_lite.data.collator import collate
from veomni_lite.distributed.sequence_parallel import slice_micro_batch
from veomni_lite.engines.base import RolloutRequest, SamplingSettings
from veomni_lite.engines.embedded import TransformersEngine
from veomni_lite.loss_keys import IGNORE_INDEX
from veomni_lite.models.routing import record_routing, routers, routing_mismatch
from veomni_lite.rl.config import RLConfig
from veomni_lite.rl.logprob_pass import _response_values, _sample_experts, fill, policy_logprobs
from veomni_lite.rl.policy_loss import POLICY_LABELS, PolicyLoss
from veomni_lite.rl.rollouts import ROUTED_EXPERTS, RolloutSample, collate_rollouts
from veomni_lite.rl.trainer import RLTrainer

TOP_K, LAYERS = 2, 2
MODEL_INPUTS = ("input_ids", "position_ids", "attention_sequence_ids")


def moe() -> torch.nn.Module:
    return make_moe("qwen3_moe", seed=5, dtype=torch.float64)


def batch_of(samples: list[RolloutSample], packed: bool = False) -> dict[str, torch.Tensor]:
    return collate_rollouts(
        [s.tensors() for s in samples], lambda b: collate(b, packing=packed, share_prefixes=packed), packed
    )


def rollouts(seed: int = 0) -> list[RolloutSample]:
    """Two groups of two responses (the group's prompt shared), varied lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    out = []
    for group, (prompt, lengths) in enumerate([(ids(5), (4, 7)), (ids(3), (6, 2))]):
        out += [RolloutSample(group, prompt, ids(n), advantage=0.5 - i) for i, n in enumerate(lengths)]
    return out


def plain_routing(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[len(ids), layers, top_k] experts of a plain one-row forward (sorted within the top-k)."""
    x = torch.tensor([ids])
    with torch.no_grad(), record_routing(model) as record:
        model(input_ids=x, position_ids=torch.arange(x.shape[1])[None])
    return torch.stack(record, dim=1).sort(dim=-1).values


def sorted_experts(experts: torch.Tensor) -> torch.Tensor:
    return experts.long().sort(dim=-1).values


# ----------------------------------------------------------------- the engine records the generation's routing


@pytest.mark.parametrize("share_prompts", [True, False])
def test_engine_records_each_tokens_experts(share_prompts: bool) -> None:
    model = moe()
    engine = TransformersEngine(copy.deepcopy(model.hf_model), torch.device("cpu"), share_prompts=share_prompts,
                                record_experts=True)  # fmt: skip
    requests = [RolloutRequest([5, 9, 11, 4, 7, 3], [1, 2]), RolloutRequest([8, 6], [3, 4, 5])]
    settings = SamplingSettings(temperature=1.0, max_new_tokens=6)
    results = engine.generate(requests, settings)
    for request, rows in zip(requests, results):
        for rollout in rows:
            tokens = request.prompt_ids + rollout.response_ids
            experts = rollout.routed_experts
            assert experts is not None and experts.shape == (len(tokens), LAYERS, TOP_K)
            assert experts.dtype == torch.uint8
            # every token run (all but the last response token, never fed back) routed as a plain forward routes it
            assert torch.equal(sorted_experts(experts[:-1]), plain_routing(model, tokens)[:-1])
            assert experts[-1].tolist() == [[0, 1]] * LAYERS
    plain = TransformersEngine(copy.deepcopy(model.hf_model), torch.device("cpu"), share_prompts=share_prompts)
    assert all(r.routed_experts is None for rows in plain.generate(requests, settings) for r in rows)


# ----------------------------------------------------------------- layout: collate, packing, SP, read back


@pytest.mark.parametrize("packed", [False, True])
def test_collate_lays_out_each_samples_experts(packed: bool) -> None:
    samples = rollouts()
    g = torch.Generator().manual_seed(1)
    for sample in samples:
        sample.routed_experts = torch.randint(0, 8, (len(sample), LAYERS, TOP_K), generator=g, dtype=torch.uint8)
    for first, second in (samples[0:2], samples[2:4]):  # a group's prompt: the same tokens, the same experts
        second.routed_experts[: len(second.prompt_ids)] = first.routed_experts[: len(first.prompt_ids)]
    whole = batch_of(samples, packed)
    experts = whole[ROUTED_EXPERTS]
    assert experts.shape == (*whole["input_ids"].shape, LAYERS, TOP_K) and experts.dtype == torch.int32
    if packed:  # the shared prefixes are kept once
        assert whole["input_ids"].shape[1] < sum(len(s) for s in samples)
    for position, sample in enumerate(samples):
        assert torch.equal(_sample_experts(whole, experts, samples, position), sample.routed_experts)
    if not packed:  # padding: a valid choice of distinct experts
        assert experts[3, len(samples[3]) :].tolist() == [[[0, 1]] * LAYERS] * (experts.shape[1] - len(samples[3]))
    shards = [slice_micro_batch(whole, rank, 2)[ROUTED_EXPERTS] for rank in range(2)]
    assert torch.equal(torch.cat(shards, dim=1)[:, : experts.shape[1]], experts)


# ----------------------------------------------------------------- old: the old pass's experts, replayed in training


def context_for(model: torch.nn.Module, samples: list[RolloutSample], replay: str, packed: bool) -> SimpleNamespace:
    parallel = SimpleNamespace(rank=0, world_size=1, sp_size=1, sp_rank=0, sp_group=None)
    return SimpleNamespace(
        model=model, critic=None, parallel=parallel, reference=None, control_group=None, on_policy=False,
        rl=SimpleNamespace(temperature=1.0, routing_replay=replay, mask_truncated=False),
        collate=lambda tensors: collate_rollouts(
            tensors, lambda b: collate(b, packing=packed, share_prefixes=packed), packed),
        shard=lambda batch: batch, logprobs=functools.partial(policy_logprobs, model, torch.device("cpu")),
    )  # fmt: skip


def trainer_forward(
    model: torch.nn.Module, micro_batch: dict[str, torch.Tensor], replay: str = "old"
) -> tuple[RLTrainer, dict, torch.Tensor]:
    """`RLTrainer.forward` on a trainer holding only what it reads; (its outputs, the log-probs it trained on). The
    replay stays on until `trainer.replay` closes (after the backward)."""
    trainer = object.__new__(RLTrainer)
    loss = PolicyLoss.of(RLConfig(temperature=1.0))
    seen: list[torch.Tensor] = []

    def policy(outputs, batch, group):  # noqa: ANN001, ANN202 - the loss, keeping the log-probs it was given
        seen.append(outputs["logprobs"])
        return loss(outputs, batch, group)

    trainer.__dict__.update(
        model=model, device=torch.device("cpu"), rl=RLConfig(temperature=1.0, routing_replay=replay), policy=policy,
        critic=None,
        parallel=SimpleNamespace(sp_size=1, sp_group=None), replay=contextlib.ExitStack(),
    )  # fmt: skip
    outputs = trainer.forward(micro_batch)
    return trainer, outputs, seen[0]


def response_logprobs(whole: dict, logp: torch.Tensor, samples: list[RolloutSample]) -> torch.Tensor:
    return torch.tensor([x for i in range(len(samples)) for x in _response_values(whole, logp, samples, i)])


def nudge_routers(model: torch.nn.Module, scale: float) -> None:
    """An update of the routers alone (as an optimizer step moves them): flips some top-k choices."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for router in routers(model):
            router.weight.add_(torch.randn(router.weight.shape, generator=g, dtype=router.weight.dtype) * scale)


@pytest.mark.parametrize("packed", [False, True])
def test_old_replay_reproduces_the_old_pass_and_keeps_its_routing(packed: bool) -> None:
    model = moe().eval()
    samples = rollouts()
    context = context_for(model, samples, "old", packed)
    fill(context, samples, [[(samples, [0, 1, 2, 3])]])
    for sample in samples:  # the old pass's routing of each sample's own tokens
        assert sample.routed_experts.shape == (len(sample), LAYERS, TOP_K)
        run = slice(0, len(sample) - 1)  # the last position predicts nothing kept
        own = plain_routing(model, sample.prompt_ids + sample.response_ids)
        assert torch.equal(sorted_experts(sample.routed_experts[run]), own[run])
    whole = batch_of(samples, packed)
    old = torch.tensor([x for s in samples for x in s.old_logprobs])
    valid = whole[POLICY_LABELS] != IGNORE_INDEX
    counted = int(valid.sum()) * LAYERS

    # the same weights: the training forward is the old pass, bit for bit, and counts no mismatch
    seen, handles = experts_see(model)
    trainer, outputs, logp = trainer_forward(model, dict(whole))
    trainer.replay.close()
    for handle in handles:
        handle.remove()
    assert torch.equal(response_logprobs(whole, logp.detach().double(), samples), old)
    assert [int(x) for x in outputs["metrics"]["rl/routing/mismatch"]] == [0, counted]
    assert seen, "the experts modules ran"

    # the routers updated: without replay the routing moves; with it, the experts are the old pass's exactly
    nudge_routers(model, 0.3)
    stored = list(whole[ROUTED_EXPERTS].flatten(0, 1).unbind(1))
    with torch.no_grad(), record_routing(model) as own:
        model(**{k: v for k, v in whole.items() if k in MODEL_INPUTS})
    moved = routing_mismatch(own, stored, valid)
    assert int(moved[0]) > 0, "the nudge flips some decisions (else this test shows nothing)"
    free = {k: v for k, v in whole.items() if k != ROUTED_EXPERTS}
    _, free_outputs, free_logp = trainer_forward(model, free)
    assert "rl/routing/mismatch" not in free_outputs["metrics"]
    trainer, outputs, logp = trainer_forward(model, dict(whole))
    assert [int(x) for x in outputs["metrics"]["rl/routing/mismatch"]] == [int(x) for x in moved]
    outputs["policy_loss"].backward()  # inside the replay, as the train loop's backward
    trainer.replay.close()
    assert all(float(router.weight.grad.abs().sum()) > 0 for router in routers(model)), "the router still trains"
    differ = lambda logp: (response_logprobs(whole, logp.detach().double(), samples) - old).abs().sum()  # noqa: E731
    assert differ(logp) < differ(free_logp), "replay keeps the training forward nearer the old pass"


def test_replayed_forward_hands_the_experts_exactly_the_stored_ones() -> None:
    """The experts modules receive the stored indices themselves (not the router's own), and a wrong recording is
    seen as wrong (negative control)."""
    model = moe().eval()
    samples = rollouts()
    fill(context_for(model, samples, "old", False), samples, [[(samples, [0, 1, 2, 3])]])
    whole = batch_of(samples)
    nudge_routers(model, 0.3)
    for shift in (0, 1):
        batch = dict(whole)
        batch[ROUTED_EXPERTS] = (whole[ROUTED_EXPERTS] + shift) % 8
        seen, handles = experts_see(model)
        trainer, _, _ = trainer_forward(model, batch)
        trainer.replay.close()
        for handle in handles:
            handle.remove()
        stored = list(whole[ROUTED_EXPERTS].flatten(0, 1).unbind(1))
        assert len(seen) == LAYERS
        same = all(torch.equal(s.long(), e.long()) for s, e in zip(seen, stored))
        assert same == (shift == 0)


@pytest.mark.parametrize("global_f", [True, False])
def test_without_replay_the_old_pass_records_the_experts_for_global_batch_f_only(global_f: bool) -> None:
    """`rl.routing_replay: none` under `moe.balance: global-batch` (`RolloutContext.global_f`): the old pass records
    each sample's experts (the step's f, `RouterLosses.step_slots`), and the trainer's forward does not replay them;
    without global-batch nothing is recorded."""
    model = moe().eval()
    samples = rollouts()
    context = context_for(model, samples, "none", False)
    context.global_f = global_f
    fill(context, samples, [[(samples, [0, 1, 2, 3])]])
    if not global_f:
        assert all(sample.routed_experts is None for sample in samples)
        return
    for sample in samples:
        run = slice(0, len(sample) - 1)
        own = plain_routing(model, sample.prompt_ids + sample.response_ids)
        assert torch.equal(sorted_experts(sample.routed_experts[run]), own[run])
    whole = batch_of(samples)
    nudge_routers(model, 0.3)  # the router's own choices now differ from the recorded ones
    with torch.no_grad(), record_routing(model) as own:
        model(**{k: v for k, v in whole.items() if k in MODEL_INPUTS})
    seen, handles = experts_see(model)
    _, outputs, _ = trainer_forward(model, dict(whole), replay="none")
    for handle in handles:
        handle.remove()
    assert all(torch.equal(s.long(), o.long()) for s, o in zip(seen, own)), "the router's own experts, not replayed"
    assert not all(torch.equal(o.long(), r.long()) for o, r in zip(own, whole[ROUTED_EXPERTS].flatten(0, 1).unbind(1)))
    assert "rl/routing/mismatch" not in outputs["metrics"]


def test_replay_holds_through_an_activation_checkpointing_recompute() -> None:
    """With each decoder layer checkpointed, the backward recomputes the forward: the trainer keeps the replay on
    until the micro-batch's backward has run, so the gradients are those without checkpointing; closing it before
    the backward (negative control) recomputes with the router's own experts: other gradients, or torch's
    checkpoint error."""
    from veomni_lite.distributed.fsdp import checkpoint_activations

    model = moe().eval()
    samples = rollouts()
    fill(context_for(model, samples, "old", False), samples, [[(samples, [0, 1, 2, 3])]])
    whole = batch_of(samples)
    nudge_routers(model, 0.3)

    def gradients(checkpointed: bool, close_early: bool = False) -> list[torch.Tensor]:
        each = copy.deepcopy(model)
        if checkpointed:
            checkpoint_activations(list(each.layers))
        trainer, outputs, _ = trainer_forward(each, dict(whole))
        if close_early:
            trainer.replay.close()
        outputs["policy_loss"].backward()
        trainer.replay.close()
        return [p.grad.clone() for p in each.parameters() if p.grad is not None]

    plain = gradients(False)
    assert all(torch.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(gradients(True), plain))
    try:  # torch's checkpoint often notices the other experts' computation itself (other tensors saved)
        early = gradients(True, close_early=True)
    except torch.utils.checkpoint.CheckpointError:
        return
    assert not all(torch.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(early, plain))


# ----------------------------------------------------------------- rollout: the generation's experts


def test_rollout_replay_matches_the_generation() -> None:
    """Same weights: the trainer's log-probs under the generation's experts are the engine's (float64 weights, KV
    cache against a full forward; the engine's log-softmax is float32's). An engine whose routers differ (another
    precision's rounding, made large): without replay the trainer routes its own way; replay keeps it on the
    generation's experts, nearer its log-probs."""
    model = moe().eval()
    settings = SamplingSettings(temperature=1.0, max_new_tokens=6)
    requests = [RolloutRequest([5, 9, 11, 4, 7, 3], [1, 2]), RolloutRequest([8, 6, 13], [3, 4])]

    def generated(engine_model: torch.nn.Module) -> list[RolloutSample]:
        engine = TransformersEngine(engine_model, torch.device("cpu"), record_experts=True)
        return [
            RolloutSample(g, r.prompt_ids, o.response_ids, engine_logprobs=o.logprobs, routed_experts=o.routed_experts)
            for g, (r, rows) in enumerate(zip(requests, engine.generate(requests, settings)))
            for o in rows
        ]

    samples = generated(copy.deepcopy(model.hf_model))
    whole = batch_of(samples)
    engine = torch.tensor([x for s in samples for x in s.engine_logprobs])
    replayed_logp = response_logprobs(whole, policy_logprobs(model, torch.device("cpu"), dict(whole), 1.0), samples)
    # the engine takes its log-softmax in float32: a few float32 roundings of numbers of |logp|'s size
    tolerance = 16 * torch.finfo(torch.float32).eps * (1 + float(engine.abs().max()))
    assert torch.allclose(replayed_logp, engine, rtol=0, atol=tolerance)

    other = copy.deepcopy(model)
    nudge_routers(other, 0.3)
    samples = generated(other.hf_model)
    whole = batch_of(samples)
    engine = torch.tensor([x for s in samples for x in s.engine_logprobs])
    free = {k: v for k, v in whole.items() if k != ROUTED_EXPERTS}
    with_replay = response_logprobs(whole, policy_logprobs(model, torch.device("cpu"), dict(whole), 1.0), samples)
    without = response_logprobs(whole, policy_logprobs(model, torch.device("cpu"), free, 1.0), samples)
    _, outputs, _ = trainer_forward(model, dict(whole))
    assert int(outputs["metrics"]["rl/routing/mismatch"][0]) > 0
    assert (with_replay - engine).abs().mean() < (without - engine).abs().mean()


# ----------------------------------------------------------------- configuration


def test_rollout_replay_needs_an_engine_that_records() -> None:
    base = ["--model.pretrained_dir", "x", "--data.train_path", "x", "--rl.rewards", "[{name: c, function: math}]"]
    with pytest.raises(ConfigError, match="vLLM engine does not return"):
        load_config(None, [*base, "--rl.routing_replay", "rollout", "--rl.engine", "vllm", "--rl.vllm",
                           "{url: http://x}"], world_size=1, sections={"rl": RLConfig})  # fmt: skip
    with pytest.raises(ConfigError, match="rollouts_path's rollouts carry none"):
        load_config(None, [*base, "--rl.routing_replay", "rollout", "--rl.rollouts_path", "r.jsonl"], world_size=1,
                    sections={"rl": RLConfig})  # fmt: skip
    load_config(None, [*base, "--rl.routing_replay", "old"], world_size=1, sections={"rl": RLConfig})


# ----------------------------------------------------------------- the trainer, end to end


@pytest.fixture(scope="module")
def math_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The math demo's prompts, and a tiny Qwen3-MoE directory with its Qwen2's tokenizer (`models/qwen3_moe`)."""
    from examples.rl_math import write_demo

    demo = write_demo(tmp_path_factory.mktemp("rl_math"), sft_rows=16, rl_rows=32, eval_rows=4)
    write_moe_directory(demo / "models/qwen2_math", demo / "models/qwen3_moe", TOP_K, LAYERS)
    return demo


def rl_run_args(demo: Path, out: Path, model: str, *extra: str) -> list[str]:
    """Rollout batches of 4 prompts x 4 samples in 2 mini-batches (off policy: the old pass runs), 2 steps."""
    return [
        "--model.arch", "auto", "--model.pretrained_dir", str(demo / "models" / model),
        "--data.train_path", str(demo / "rl_train.jsonl"), "--data.format", "messages", "--data.max_seq_len", "64",
        "--rl.prompts_per_step", "4", "--rl.num_generations", "4", "--rl.max_new_tokens", "8",
        "--rl.rewards", "[{name: correct, function: math}]",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "8", "--train.max_steps", "2",
        "--train.output_dir", str(out), "--optim.lr", "1e-3", "--optim.warmup_steps", "0",
        "--logging.log_interval", "1", "--logging.progress_bar", "false", "--logging.tensorboard", "false",
        "--logging.plot", "false", *extra,
    ]  # fmt: skip


def rl_run(demo: Path, out: Path, model: str, *extra: str) -> RLTrainer:
    """`rl_run_args`' trainer, one process."""
    return RLTrainer(load_config(None, rl_run_args(demo, out, model, *extra), world_size=1, sections={"rl": RLConfig}))


@pytest.mark.slow
@pytest.mark.parametrize("replay", ["old", "rollout"])
def test_rl_trains_an_moe_policy_with_routing_replay(math_moe: Path, tmp_path: Path, replay: str) -> None:
    """Each step records `rl/routing/mismatch` (a share); the router's balance coefficient is RL's default 0."""
    trainer = rl_run(math_moe, tmp_path, "qwen3_moe", "--rl.routing_replay", replay, "--data.packing", "true")
    assert trainer.router is not None and trainer.router.aux_coef == 0.0
    train_built(trainer)
    events = [e for e in read_events(tmp_path) if "rl/routing/mismatch" in e]
    assert [e["step"] for e in events] == [1, 2]
    assert all(0.0 <= e["rl/routing/mismatch"] <= 1.0 for e in events)
    if replay == "old":  # step 1's weights are the old pass's: the replayed routing is the training forward's own
        assert events[0]["rl/routing/mismatch"] == 0.0


def test_routing_replay_needs_an_moe_policy(math_moe: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="has no mixture-of-experts router"):
        rl_run(math_moe, tmp_path, "qwen2_math", "--rl.routing_replay", "old")


def _ranked(rank: int, world: int, args: list[str]) -> None:
    train_built(RLTrainer(load_config(None, args, world_size=world, sections={"rl": RLConfig})))


@pytest.mark.slow
def test_old_replay_places_each_samples_experts_on_every_layout(math_moe: Path, tmp_path: Path) -> None:
    """`old` on given rollouts (2 mini-batches x 2 epochs: the old pass runs) at one process, DP=2, SP=2 (packed,
    a token budget) and packed with shared prefixes: the first step trains the old pass's weights, so its replayed
    experts are its own top-k exactly where each sample's recording went back to its tokens' positions after
    planning, packing, the SP gather and the SP slice: `rl/routing/mismatch` 0 at step 1 on every layout (a
    misplaced recording counts its tokens' other experts; the later steps, after updates, move some decisions)."""
    from tests.dist_helpers import run_distributed
    from tests.rl.test_train_rl import rl_args, write_rollouts

    rollouts = write_rollouts(tmp_path / "rollouts.jsonl", vocab=400)
    layouts = {
        "one": (1, []),
        "packed": (1, ["--data.packing", "true"]),
        "dp2": (2, []),
        "sp2": (2, ["--parallel.sp_size", "2", "--data.packing", "true", "--data.shared_prefix", "false",
                    "--data.max_tokens_per_micro_batch", "40"]),
    }  # fmt: skip
    moved = {}
    for name, (world, extra) in layouts.items():
        args = rl_args(math_moe, rollouts, tmp_path / name, "--rl.routing_replay", "old", "--train.max_steps", "4",
                       "--optim.lr", "5e-2", *extra)  # fmt: skip
        args[args.index("--model.pretrained_dir") + 1] = str(math_moe / "models/qwen3_moe")
        if world == 1:
            _ranked(0, 1, args)
        else:
            run_distributed(_ranked, world, args, timeout_s=600)
        series = {
            e["step"]: e["rl/routing/mismatch"] for e in read_events(tmp_path / name) if "rl/routing/mismatch" in e
        }
        assert sorted(series) == [1, 2, 3, 4], (name, series)
        assert series[1] == 0.0, (name, series)
        moved[name] = series
    assert any(v > 0 for series in moved.values() for v in series.values()), f"no update moved a decision: {moved}"


@pytest.mark.slow
def test_a_resumed_rollout_batch_replays_the_experts_its_checkpoint_holds(math_moe: Path, tmp_path: Path) -> None:
    """Stopped at step 3 of a batch of 4 steps and resumed: the checkpoint's samples hold their recorded experts
    (no old pass runs again), so step 4 replays them as the uninterrupted run does."""
    from tests.rl.test_train_rl import rl_args, write_rollouts

    rollouts = write_rollouts(tmp_path / "rollouts.jsonl", vocab=400)

    def args(out: str, *extra: str) -> list[str]:
        args = rl_args(math_moe, rollouts, tmp_path / out, "--rl.routing_replay", "old", "--train.max_steps", "4",
                       "--optim.lr", "5e-2", *extra)  # fmt: skip
        args[args.index("--model.pretrained_dir") + 1] = str(math_moe / "models/qwen3_moe")
        return args

    def series(out: str) -> dict[int, tuple[float, float]]:
        keys = ("rl/routing/mismatch", "train/policy_loss")
        return {e["step"]: tuple(e[k] for k in keys) for e in read_events(tmp_path / out) if keys[0] in e}

    _ranked(0, 1, args("whole"))
    train_built(RLTrainer(load_config(None, args("cut"), world_size=1, sections={"rl": RLConfig})), stop_after=3)
    assert sorted(series("cut")) == [1, 2, 3]
    _ranked(0, 1, args("cut", "--checkpoint.resume", "true"))
    assert series("cut")[4] == pytest.approx(series("whole")[4], rel=1e-6, abs=1e-9)
