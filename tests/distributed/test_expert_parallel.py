"""Expert parallelism (`parallel.ep_size`) on real gloo ranks, float64 (the tiny Qwen3-MoE of `moe_fixtures`: 8
experts, top-2, 2 layers, float64 routers), against ep_size 1 on the same layout, step by step.

Each layout trains 3 optimizer steps the trainer's way (`LossStep` with the router heads' counts and the previous
step's global-batch counts in its one all-reduce, `RouterLosses.routed`, FSDP2 via `apply_fsdp`, the clipped global
grad norm, AdamW): every head's global loss (foundation, router_aux, router_z), the grad norm and every parameter
after each step equal ep_size 1's to float64 rounding. The micro-batches hold uneven expert loads (a micro-batch of
one 2-token row: most experts get no row from that rank; checked, not assumed), an empty micro-batch (a padding copy
on every rank but one) and gradient accumulation; each rank makes the same number of all-to-alls on the ep group
(counted), 5 per MoE layer and micro-batch (3 forward, 2 backward). A dispatch that sends rows to the wrong experts
fails the comparison (negative control). A DCP checkpoint of ep_size 2 resumes at ep_size 1 and 4 with the next step
of the uninterrupted run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from tests.dist_helpers import run_distributed
from tests.models.moe_fixtures import moe_samples, packed_shared, padded, tiny_moe
from veomni_lite.config_sections import OptimConfig
from veomni_lite.data.packing import padding_micro_batch
from veomni_lite.distributed import expert_parallel
from veomni_lite.distributed.collectives import all_reduce
from veomni_lite.distributed.fsdp import apply_fsdp, checkpoint_activations, set_gradient_sync
from veomni_lite.distributed.grad_norm import clip_global_grad_norm
from veomni_lite.distributed.parallel_state import destroy_parallel_state, get_parallel_state, init_parallel_state
from veomni_lite.distributed.sequence_parallel import slice_micro_batch
from veomni_lite.models.moe import RouterLosses
from veomni_lite.plain_loop import LossStep
from veomni_lite.trainer.base import build_optimizer
from veomni_lite.trainer.checkpoint import CheckpointManager

STEPS = 3
GA = 2
F64 = 1e-10  # float64 rounding, amplified by AdamW where a gradient is tiny (g / sqrt(v))


def _micro_batches(
    step: int, dp: int, dp_rank: int, sp: int, sp_rank: int, packed: bool = False
) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches of `step`: its share of 8 samples in GA micro-batches (padded, or packed into one
    row with their shared prompts once), then one micro-batch that holds a 2-token row on dp rank 0 and is an empty
    (padding) copy of it elsewhere."""
    samples = moe_samples(seed=10 + step)
    mine = samples[dp_rank::dp]
    per = len(mine) // GA
    collate = packed_shared if packed else padded
    batches = [collate(mine[i * per : (i + 1) * per]) for i in range(GA)]
    tiny = padded([{"input_ids": samples[0]["input_ids"][:2], "labels": samples[0]["input_ids"][:2]}])
    batches.append(tiny if dp_rank == 0 else padding_micro_batch(tiny))
    return [slice_micro_batch(batch, sp_rank, sp) for batch in batches]


@contextlib.contextmanager
def counting_ep_all_to_alls(log: list[int]) -> Iterator[None]:
    """Count `all_to_all_single` calls on the ep group (Ulysses' own on the sp group are not counted)."""
    import torch.distributed as dist

    original = dist.all_to_all_single

    def counted(*args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group", args[4] if len(args) > 4 else None)
        if group is not None and group is get_parallel_state().ep_group:
            log.append(1)
        return original(*args, **kwargs)

    dist.all_to_all_single = counted
    try:
        yield
    finally:
        dist.all_to_all_single = original


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (collective: every rank, same order)."""
    return {
        name: (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()
        for name, param in model.named_parameters()
    }


class EPLayout(NamedTuple):
    sp: int
    ep: int
    ac: bool = False  # activation checkpointing
    replicate: int = 1  # HSDP
    packed: bool = False  # packed rows with shared prompts

    @property
    def name(self) -> str:
        flags = ("_ac" if self.ac else "") + (f"_hsdp{self.replicate}" if self.replicate > 1 else "")
        return f"sp{self.sp}_ep{self.ep}{flags}" + ("_packed" if self.packed else "")

    @property
    def reference(self) -> str:
        """The layout's name at ep 1 (activation checkpointing off)."""
        return EPLayout(self.sp, 1, False, self.replicate, self.packed).name


def _build(
    world: int, sp: int, ep: int, checkpointing: bool = False, replicate: int = 1, packed: bool = False
) -> tuple[Any, RouterLosses, Any]:
    state = init_parallel_state(world // sp, sp, timeout_s=120, dp_replicate=replicate, ep_size=ep)
    model = tiny_moe()
    router = RouterLosses(model, "global-batch", aux_coef=0.1, z_coef=0.01)
    if sp > 1:
        model.enable_sequence_parallel(state.sp_group)
    if checkpointing:
        checkpoint_activations(model.layers)
    model = apply_fsdp(model, state, model.layers)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.01))
    return model, router, optimizer


def _train_steps(
    model: Any, router: RouterLosses, optimizer: Any, steps: range, packed: bool = False
) -> list[dict[str, Any]]:
    """The trainer's step sequence (see the module docstring); per step: the heads' global losses, the grad norm,
    the ep all-to-alls of this rank, whether some expert got no row from this rank in some forward, the parameters."""
    state = get_parallel_state()
    keys = ("foundation_loss", *router.loss_keys)
    idle: list[bool] = []
    gathered: list[int] = []  # the experts a forward holds whole (after FSDP2's all-gather)

    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        idle.append(bool((torch.bincount(args[1].reshape(-1), minlength=8) == 0).any()))
        gathered.append(expert_parallel._local(module.gate_up_proj).shape[0])

    hooks = [experts.register_forward_pre_hook(hook) for experts in expert_parallel.expert_modules(model)]
    no_row: list[bool] = []  # a forward in which no rank sent this rank a row
    grouped = expert_parallel.grouped_linear
    expert_parallel.grouped_linear = lambda x, *args: no_row.append(not x.shape[0]) or grouped(x, *args)
    records = []
    for step_index in steps:
        batches = _micro_batches(step_index, state.dp_size, state.dp_rank, state.sp_size, state.sp_rank, packed)
        calls: list[int] = []
        with counting_ep_all_to_alls(calls):
            step = LossStep(
                batches, marked=True, extra_counts=router.counts, slots=router.step_slots(torch.device("cpu"))
            )
            router.set_global_counts(step.step_slots(keys))
            heads = torch.zeros(len(keys), dtype=torch.float64)
            for index, (batch, tokens) in enumerate(step):
                set_gradient_sync(model, index == len(step) - 1)
                outputs = router.routed(model, batch, lambda b: model(**b))
                scaled = step.scaled({key: outputs[key] for key in keys}, tokens)
                sum(scaled.values()).backward()
                heads += torch.stack([scaled[key].detach() for key in keys])
            params = [p for p in model.parameters() if p.requires_grad]
            norm, _ = clip_global_grad_norm(params, 0.5, heads.sum(), state.world_group)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        heads = all_reduce(heads, op="sum", group=state.world_group)
        records.append(
            {"heads": dict(zip(keys, heads.tolist())), "grad_norm": float(norm), "all_to_alls": len(calls)}
            | {
                "idle_expert": any(idle),
                "gathered_experts": max(gathered),
                "no_row": any(no_row),
                "params": _full(model),
            }
        )
        idle.clear()
        gathered.clear()
        no_row.clear()
    for hook in hooks:
        hook.remove()
    expert_parallel.grouped_linear = grouped
    return records


def _layouts(rank: int, world: int, layouts: list[EPLayout], broken: bool = False) -> dict[str, Any]:
    """Train each layout from the same start; `broken`: the experts' dispatch
    sends each row to the next local expert (the negative control)."""
    if broken:
        original = expert_parallel.grouped_linear
        expert_parallel.grouped_linear = lambda x, w, counts, t: original(x, w.roll(1, 0), counts, t)
    out = {}
    for layout in layouts:
        model, router, optimizer = _build(world, *layout)
        out[layout.name] = _train_steps(model, router, optimizer, range(STEPS), layout.packed)
        destroy_parallel_state()
    return out


def assert_steps_equal(got: list[dict[str, Any]], want: list[dict[str, Any]], what: str) -> float:
    """Every head, the grad norm and every parameter of each step equal to float64 rounding; returns the worst
    relative difference."""
    worst = 0.0
    for step, (have, ref) in enumerate(zip(got, want, strict=True)):
        for key, value in ref["heads"].items():
            worst = max(worst, abs(have["heads"][key] - value) / abs(value))
        worst = max(worst, abs(have["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"])
        for name, param in ref["params"].items():
            worst = max(worst, float((have["params"][name] - param).abs().max() / param.abs().max()))
        assert worst < F64, f"{what} step {step + 1}: {worst:.2e}"
    return worst


def _check_against_ep1(results: list[dict[str, Any]], layouts: list[EPLayout]) -> None:
    for index, rank_result in enumerate(results):  # every rank gathered the same whole parameters
        for layout in layouts:
            name, ep, ac = layout.name, layout.ep, layout.ac
            reference = rank_result[layout.reference]
            worst = assert_steps_equal(rank_result[name], reference, name)
            for step in rank_result[name]:
                layers, micro_batches = 2, GA + 1
                assert step["all_to_alls"] == ((5 + 3 * ac) * layers * micro_batches if ep > 1 else 0), name
                assert step["gathered_experts"] == 8 // ep, name
            if index == 0:
                print(
                    f"{name}: worst relative difference to ep 1 over {STEPS} steps {worst:.1e}; "
                    f"ep all-to-alls per step {rank_result[name][0]['all_to_alls']} ({layers} MoE layers x "
                    f"{micro_batches} micro-batches), experts held whole per forward {step['gathered_experts']} of 8; "
                    f"a rank received no row in {sum(st['no_row'] for r in results for st in r[name])} rank-steps"
                )
    assert any(step["idle_expert"] for r in results for step in r["sp1_ep2"]), "no rank left an expert idle"
    if "sp1_ep4" in results[0]:  # some rank got no row at all from any rank in some forward (the 2-token micro-batch)
        assert any(step["no_row"] for r in results for step in r["sp1_ep4"])
    first = results[0]["sp1_ep1"]
    assert all(step["heads"]["router_aux_loss"] > 0 and step["heads"]["router_z_loss"] > 0 for step in first)
    assert first[0]["params"].keys() == first[-1]["params"].keys()
    moved = max(float((a - b).abs().max()) for a, b in zip(first[0]["params"].values(), first[-1]["params"].values()))
    assert moved > 1e-4  # the steps train


@pytest.mark.slow
def test_dp2_ep2_with_activation_checkpointing_or_packing_equals_ep1_and_a_wrong_dispatch_does_not():
    layouts = [EPLayout(1, 1), EPLayout(1, 2), EPLayout(1, 2, ac=True), EPLayout(1, 1, packed=True)]
    layouts += [EPLayout(1, 2, packed=True)]
    _check_against_ep1(run_distributed(_layouts, 2, layouts, timeout_s=600), layouts)
    broken = run_distributed(_layouts, 2, layouts[:2], True, timeout_s=600)[0]
    with pytest.raises(AssertionError, match="sp1_ep2 step 1"):
        assert_steps_equal(broken["sp1_ep2"], broken["sp1_ep1"], "sp1_ep2")


@pytest.mark.slow
def test_dp4_ep2_dp4_ep4_dp2_sp2_ep2_and_hsdp_ep2_equal_ep1():
    layouts = [EPLayout(1, 1), EPLayout(1, 2), EPLayout(1, 4), EPLayout(2, 1), EPLayout(2, 2)]
    layouts += [EPLayout(1, 1, replicate=2), EPLayout(1, 2, replicate=2)]  # HSDP: 2 shard blocks of 2 ranks
    _check_against_ep1(run_distributed(_layouts, 4, layouts, timeout_s=900), layouts)


# ---------------------------------------------------------------- checkpoints across ep sizes


def _resume_across(rank: int, world: int, root: str) -> dict[str, Any]:
    """ep 2: 2 steps, a DCP checkpoint (model, optimizer, the router's counts), the 3rd step; then ep 1 and ep 4 each
    resume from the checkpoint and train the 3rd step."""
    out = {}
    model, router, optimizer = _build(world, 1, 2)
    _train_steps(model, router, optimizer, range(2))
    manager = CheckpointManager(Path(root))
    state = get_parallel_state()
    router_state = router.state_dict(state.world_group, rank == 0)
    manager.save(2, model, optimizer, {"router": router_state}, {})
    out["uninterrupted"] = _train_steps(model, router, optimizer, range(2, 3))
    destroy_parallel_state()
    for ep in (1, 4):
        model, router, optimizer = _build(world, 1, ep)
        step, trainer_state, _ = manager.load_latest(model, optimizer)
        assert step == 2
        router.load_state_dict(trainer_state["router"], rank == 0)
        out[f"ep{ep}"] = _train_steps(model, router, optimizer, range(2, 3))
        destroy_parallel_state()
    return out


@pytest.mark.slow
def test_a_checkpoint_of_ep2_resumes_at_ep1_and_ep4_with_the_uninterrupted_step(tmp_path):
    result = run_distributed(_resume_across, 4, str(tmp_path / "checkpoints"), timeout_s=900)[0]
    for ep in (1, 4):
        worst = assert_steps_equal(result[f"ep{ep}"], result["uninterrupted"], f"resumed at ep {ep}")
        print(f"resumed at ep {ep}: worst relative difference {worst:.1e}")


# ---------------------------------------------------------------- weights: a transformers directory, whole tensors out


def _load_directory(rank: int, world: int, directory: str) -> dict[str, Any]:
    """At ep 1, 2 and 4: the directory read into the shards (bytes each rank reads, which experts), every parameter
    gathered against transformers' whole load, and the engines' whole weights (`full_hf_state`)."""
    from torch.distributed.checkpoint import hf_storage

    from tests.models.moe_configs import token_batch
    from veomni_lite.engines.weights import full_hf_state
    from veomni_lite.models.registry import family_of
    from veomni_lite.models.sharded_load import build_on_meta, load_into_shards

    whole = family_of(build_on_meta(directory).config).load(directory).state_dict()
    read: list[tuple[str, int, int]] = []  # (stored name, its expert or -1, bytes read)
    original = hf_storage.HuggingFaceStorageReader._process_read_request

    def counted(self: Any, f: Any, req: Any, planner: Any) -> None:
        name = req.storage_index.fqn
        expert = int(name.split(".experts.")[1].split(".")[0]) if ".experts." in name else -1
        width = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2}[f.get_slice(name).get_dtype()]
        read.append((name, expert, torch.Size(req.lengths).numel() * width))
        original(self, f, req, planner)

    hf_storage.HuggingFaceStorageReader._process_read_request = counted
    out = {}
    try:
        for ep in (1, 2, 4):
            state = init_parallel_state(world, 1, timeout_s=120, ep_size=ep)
            model = build_on_meta(directory)
            apply_fsdp(model, state, model.layers)
            model.to_empty(device="cpu")
            read.clear()
            load_into_shards(model, directory)
            stored, gathered = expert_parallel.expert_bytes(model, ep)
            batch = {key: value[rank::world] for key, value in token_batch(batch=8, seq=10, seed=5).items()}
            model(**batch)["foundation_loss"].backward()  # float32: FSDP2's reductions of the experts on gloo
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            diffs = {n: float((p.full_tensor() - whole[n]).abs().max()) for n, p in model.state_dict().items()}
            engine = full_hf_state(model)
            whole_experts = all(
                torch.equal(engine[n.removeprefix("hf_model.")], whole[n]) for n in whole if "experts" in n
            )
            out[ep] = {
                "bytes": sum(n for _, _, n in read),
                "expert_bytes": sum(n for _, e, n in read if e >= 0),
                "experts": sorted({e for _, e, _ in read if e >= 0}),
                "diff": max(diffs.values()),
                "engine_whole_experts": whole_experts,
                "grads": grads,
                "stored": stored,
                "gathered": gathered,
            }
            destroy_parallel_state()
    finally:
        hf_storage.HuggingFaceStorageReader._process_read_request = original
    return out


@pytest.mark.slow
def test_a_transformers_directory_loads_into_expert_shards_and_the_engines_get_whole_experts(tmp_path):
    """4 ranks, ep 1, 2 and 4: each rank reads only its 2 of the 8 experts (a quarter of the experts' bytes) and
    about a quarter of the rest; gathered, every parameter equals transformers' whole load; `full_hf_state` (the
    vLLM weight sync) gives every expert whole; a float32 forward and backward gives ep 1's gradients."""
    from tests.models.moe_configs import make_moe

    make_moe("qwen3_moe").save_pretrained(tmp_path)
    results = run_distributed(_load_directory, 4, str(tmp_path), timeout_s=900)
    total = sum(p.numel() * p.element_size() for p in make_moe("qwen3_moe").parameters())
    experts_total = sum(
        p.numel() * p.element_size() for n, p in make_moe("qwen3_moe").named_parameters() if "experts" in n
    )
    for ep in (1, 2, 4):
        per_rank = [r[ep] for r in results]
        print(
            f"ep {ep}: bytes read per rank {[r['bytes'] for r in per_rank]} of {total} (experts "
            f"{[r['expert_bytes'] for r in per_rank]} of {experts_total}); experts {[r['experts'] for r in per_rank]}; "
            f"experts held whole by a layer's forward {per_rank[0]['gathered']} bytes"
        )
        for rank, r in enumerate(per_rank):
            assert r["diff"] == 0.0 and r["engine_whole_experts"], (ep, rank)
            assert len(r["experts"]) == 2 and r["expert_bytes"] == r["stored"] == experts_total // 4, (ep, rank, r)
            assert r["gathered"] == experts_total // 2 // ep  # one of the 2 layers' experts, E / ep of them
            for name, grad in results[rank][1]["grads"].items():
                torch.testing.assert_close(r["grads"][name], grad, rtol=1e-5, atol=1e-7)
        assert sorted(e for r in per_rank for e in r["experts"]) == list(range(8))


# ---------------------------------------------------------------- the trainer (float32): config, resume, export


def _trainer_runs(rank: int, world: int, root: str, runs: dict[str, list[str]]) -> dict[str, Any]:
    """The text example for each run's arguments, one after the other: rank 0's logged events and every rank's whole
    parameters after the run."""
    from examples.qwen2_pydoc_text import PydocLMTrainer
    from tests.models.small_hf import CONFIGS, RUN
    from tests.trainer.helpers import read_events
    from veomni_lite.config import load_config

    out = {}
    for name, extra in runs.items():
        directory = str(Path(root) / name)
        args = [*RUN, "--data.seq_len", "32", "--moe.z_loss_coef", "0.001", "--train.output_dir", directory, *extra]
        trainer = PydocLMTrainer(load_config(CONFIGS["text"], args, world_size=world))
        try:
            trainer.train()
        finally:
            trainer.metrics.close()
            trainer.loader.close()
        out[name] = {"events": read_events(directory) if rank == 0 else None, "params": _full(trainer.model)}
        destroy_parallel_state()
    return out


TRAINER_KEYS = (
    "train/loss",
    "train/foundation_loss",
    "train/router_aux_loss",
    "train/router_z_loss",
    "train/grad_norm",
)


@pytest.mark.slow
def test_the_trainer_at_ep2_equals_ep1_resumes_and_exports_transformers_layout(tmp_path):
    """2 ranks, `parallel.ep_size 2` in the trainer (a model built on rank 0 and scattered into the expert shards,
    `model.load_sharded`): every logged head and the grad norm equal ep 1's, with LoRA too (experts frozen); a
    2-step run's checkpoint at ep 2 resumed at ep 1 trains step 3 as the uninterrupted ep 2 run; its export (`python
    -m veomni_lite.export`) is transformers' layout, which `from_pretrained` loads to the trained parameters."""
    from transformers import AutoModelForCausalLM

    from tests.models.small_hf import SMALL
    from tests.models.test_moe_families import MOE_RUN
    from tests.trainer.helpers import losses_by_step
    from veomni_lite.export import export

    tiny = [*SMALL["text"], *MOE_RUN]  # a tiny Qwen3-MoE (4 experts, top-2) built from the config on rank 0
    constant = ["--optim.schedule", "constant"]  # runs of 2 and 3 steps share their first 2
    runs = {
        "ep1": [*tiny, *constant, "--train.max_steps", "3"],
        "ep2": [*tiny, *constant, "--train.max_steps", "3", "--parallel.ep_size", "2"],
        "cut": [*tiny, *constant, "--checkpoint.save_interval", "2", "--parallel.ep_size", "2"],
    }
    results = run_distributed(_trainer_runs, 2, str(tmp_path), runs, timeout_s=900)[0]
    export(tmp_path / "cut", tmp_path / "exported")  # its step-2 checkpoint, written at ep 2
    exported = {n.removeprefix("hf_model."): p for n, p in results["cut"]["params"].items()}
    # LoRA on the exported directory, read into the expert shards (`load_into_shards`)
    lora = ["--model.arch", "auto", "--model.pretrained_dir", str(tmp_path / "exported")]
    lora += ["--model.lora", "{rank: 4, alpha: 8}"]
    resume = [*tiny, *constant, "--train.max_steps", "3", "--checkpoint.resume", "true", "--parallel.ep_size", "1"]
    later = {"cut": resume, "ep1_lora": lora, "ep2_lora": [*lora, "--parallel.ep_size", "2"]}
    results |= run_distributed(_trainer_runs, 2, str(tmp_path), later, timeout_s=900)[0]
    for ours, ref in ((results["ep2"], results["ep1"]), (results["ep2_lora"], results["ep1_lora"])):
        for key in TRAINER_KEYS:
            want, have = losses_by_step(ref["events"], key), losses_by_step(ours["events"], key)
            assert want and want.keys() == have.keys(), key
            assert all(have[s] == pytest.approx(want[s], rel=1e-5) for s in want), (key, have, want)
        for name, value in ref["params"].items():
            assert torch.allclose(ours["params"][name], value, rtol=1e-5, atol=1e-6), name
    lora_trained = [n for n in results["ep2_lora"]["params"] if "lora_" in n]
    assert lora_trained and not any("experts" in n for n in lora_trained)
    for key in TRAINER_KEYS:  # step 3 of the resumed run (ep 1, from ep 2's checkpoint) = the uninterrupted ep 2
        uninterrupted = losses_by_step(results["ep2"]["events"], key)[3]
        assert losses_by_step(results["cut"]["events"], key)[3] == pytest.approx(uninterrupted, rel=1e-5), key

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float32).state_dict()
    assert loaded.keys() == exported.keys()
    assert all(torch.equal(loaded[n], exported[n]) for n in loaded), "export round trip"


def _dense_at_ep2(rank: int, world: int, root: str) -> None:
    from examples.qwen2_pydoc_text import PydocLMTrainer
    from tests.models.small_hf import CONFIGS, RUN, SMALL
    from veomni_lite.config import load_config

    args = [*RUN, *SMALL["text"], "--train.output_dir", root, "--parallel.ep_size", "2"]
    PydocLMTrainer(load_config(CONFIGS["text"], args, world_size=world))


@pytest.mark.slow
def test_ep_size_on_a_dense_model_is_a_config_error_on_every_rank(tmp_path):
    from tests.dist_helpers import run_ranks

    outcomes = run_ranks(_dense_at_ep2, 2, str(tmp_path), timeout_s=300)
    for status, value in outcomes.values():
        assert (
            status == "error" and "ConfigError: parallel.ep_size (2): HFCausalLM has no fused routed experts" in value
        )


# ---------------------------------------------------------------- the other families with fused experts


def _family_grads(rank: int, world: int, families: tuple[str, ...]) -> dict[str, float]:
    """Per family: one forward and backward of this rank's half of a batch at ep 1 and ep 2 (float64 experts,
    transformers' float32 routing weights); the largest relative difference of the loss and every whole gradient."""
    from tests.models.moe_configs import make_moe, token_batch

    out = {}
    for family in families:
        runs = []
        for ep in (1, 2):
            state = init_parallel_state(world, 1, timeout_s=120, ep_size=ep)
            model = make_moe(family, seed=3, dtype=torch.float64).double()  # routers transformers keeps in float32 too
            assert len(expert_parallel.expert_modules(model)) >= 1
            model = apply_fsdp(model, state, model.layers)
            batch = {key: value[rank::world] for key, value in token_batch(batch=4, seq=10, seed=5).items()}
            loss = model(**batch)["foundation_loss"]
            loss.backward()
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
            runs.append((float(loss.detach()), grads))
            destroy_parallel_state()
        (loss1, grads1), (loss2, grads2) = runs
        diffs = [abs(loss2 - loss1) / abs(loss1)]
        diffs += [float((grads2[n] - g).abs().max() / g.abs().max().clamp(min=1e-30)) for n, g in grads1.items()]
        assert grads1.keys() == grads2.keys() and any("experts" in n for n in grads1)
        out[family] = max(diffs)
    return out


@pytest.mark.slow
def test_qwen2_moe_mixtral_olmoe_and_deepseek_v3_at_ep2_equal_ep1():
    """Every transformers family whose experts are fused 3-D parameters: the loss and every gradient at ep 2 equal
    ep 1's, up to transformers' float32 routing weights (a float64 rounding difference moves one by a float32 ulp)."""
    families = ("qwen2_moe", "mixtral", "olmoe", "deepseek_v3")
    for rank_result in run_distributed(_family_grads, 2, families, timeout_s=900):
        print(rank_result)
        assert all(diff < 1e-6 for diff in rank_result.values()), rank_result
