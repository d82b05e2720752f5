"""Many machines: HSDP trains like plain FSDP, a checkpoint moves across world sizes and layouts, ranks agree on the
checkpoint they resume, a checkpoint directory some rank cannot see is an error on every rank, and a model built on
rank 0 only and scattered into the shards equals a whole build.

Two spawns serve every test here: 2 gloo ranks (DP=2) write a checkpoint at step 2 and run the shared-directory and
agreement checks; 4 ranks then train plain FSDP, HSDP and HSDP x SP, and resume the 2-rank checkpoint at DP=1 x SP=4.
Each run is compared with one process training the same steps.
"""

from __future__ import annotations

import collections
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tests.dist_helpers import run_distributed
from tests.trainer.helpers import TRAINERS, losses_by_step, read_events, run_trainer, tiny_config
from veomni_lite.config import Config, replace
from veomni_lite.trainer.checkpoint import CheckpointError, CheckpointManager
from veomni_lite.utils import loss_utils

pytestmark = pytest.mark.slow

KIND = "vlm"
STEPS = 4
KEYS = ("train/loss", "train/grad_norm")
LAYOUTS = {  # name: parallel.* at 4 ranks (DP=4: one micro-batch per step; DP=2 x SP=2: two)
    "fsdp": {},
    "hsdp": {"dp_replicate": 2},
    "hsdp_sp": {"dp_replicate": 2, "sp_size": 2},
    "sp_sync_last": {"sp_size": 2, "gradient_sync": "last_micro_batch"},
    "sp_recompute": {"sp_size": 2, "activation_checkpointing": True},
}


def _config(output_dir: Path, resume: bool = False, **parallel: Any) -> Config:
    config = tiny_config(KIND, output_dir, max_steps=STEPS, async_step_end=False, resume=resume)
    return replace(config, parallel=parallel) if parallel else config


def _curves(output_dir: Path) -> dict[str, dict[int, float]]:
    events = read_events(output_dir)
    return {key: losses_by_step(events, key) for key in KEYS}


def _counting(trainer: Any, counts: list[collections.Counter]) -> None:
    """Wrap `trainer.train_step`: per step, the loss all-reduces, torch.distributed all-reduces on the world group
    and on other groups, and FSDP's reduce-scatters."""
    original = trainer.train_step

    def counted(name: str, fn: Any, calls: collections.Counter) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            where = "world" if group is None or group is dist.group.WORLD else "other"
            calls[f"{name}/{where}" if name == "all_reduce" else name] += 1
            return fn(*args, **kwargs)

        return call

    def train_step(micro_batches: list[dict[str, Any]]) -> None:
        calls: collections.Counter = collections.Counter()
        saved = {name: getattr(dist, name) for name in ("all_reduce", "reduce_scatter_single")}
        saved_loss = loss_utils.all_reduce
        for name, fn in saved.items():
            setattr(dist, name, counted(name, fn, calls))
        loss_utils.all_reduce = counted("loss", saved_loss, calls)
        try:
            original(micro_batches)
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)
            loss_utils.all_reduce = saved_loss
        calls["fsdp_units"] = sum(isinstance(m, FSDPModule) for m in trainer.model.modules())
        calls["micro_batches"] = len(micro_batches)
        counts.append(calls)

    trainer.train_step = train_step


def _two_ranks(rank: int, world_size: int, base: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # A node-local checkpoint directory: rank 1 sees another directory than rank 0.
    try:
        CheckpointManager(base / "local" / f"node{rank}").check_shared()
        out["local"] = "no error"
    except CheckpointError as exc:
        out["local"] = str(exc)
    shared = CheckpointManager(base / "shared")
    shared.check_shared()
    dist.barrier()  # rank 0 removes the probe after the check's last collective
    out["probe_left"] = sorted(p.name for p in shared.root.iterdir())
    # DP=2 trains 2 of 4 steps and saves (the interrupt's checkpoint), to be resumed at 4 ranks.
    run_trainer(KIND, _config(base / "written"), stop_after=2)
    # Rank 1 lists no checkpoint (as on a filesystem that lags): the ranks still resume rank 0's step together.
    if rank == 1:
        CheckpointManager.complete_checkpoints = lambda self: []  # type: ignore[method-assign]
    trainer_cls, _ = TRAINERS[KIND]
    agreed = trainer_cls(_config(base / "written", resume=True))
    out["resumed_step"] = agreed.step
    agreed.metrics.close()
    return out | _sharded_build(rank, base)


def _built_weights(kind: str, output_dir: Path, **model: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Build a trainer (no step): (its full weights and buffers by name, what `build_model` returned here and the
    CPU RNG state the build left)."""
    trainer_cls, _ = TRAINERS[kind]
    built: dict[str, Any] = {}

    class Recording(trainer_cls):  # type: ignore[misc, valid-type]
        def build_model(self) -> Any:
            model = super().build_model()
            built["devices"] = sorted({str(param.device) for param in model.parameters()})
            return model

    config = tiny_config(kind, output_dir, max_steps=STEPS, async_step_end=False)
    trainer = Recording(replace(config, model=model) if model else config)
    built["rng"] = torch.get_rng_state()
    state = trainer.model.state_dict()
    weights = {name: value.full_tensor() if isinstance(value, DTensor) else value for name, value in state.items()}
    weights |= {f"buffer {name}": buffer.clone() for name, buffer in trainer.model.named_buffers()}
    trainer.metrics.close()
    trainer.loader.close()
    return weights, built


def _sharded_build(rank: int, base: Path) -> dict[str, Any]:
    """Per kind: the sharded build (rank 0 builds, the others on meta, scattered) against every rank building the
    whole model: what each rank's `build_model` returned, and the largest difference in weights and RNG state."""
    out: dict[str, Any] = {}
    for kind in ("vlm", "qwen2_vl"):
        sharded, built = _built_weights(kind, base / f"build_{kind}_sharded")
        whole, built_whole = _built_weights(kind, base / f"build_{kind}_whole", load_sharded=False)
        assert sharded.keys() == whole.keys()
        out[kind] = {
            "devices": built["devices"],
            "whole_devices": built_whole["devices"],
            "max_diff": max(float((sharded[name] - whole[name]).abs().max()) for name in whole),
            "buffers": sum(name.startswith("buffer ") for name in whole),
            "rng_equal": torch.equal(built["rng"], built_whole["rng"]),
        }
    # A model built on meta on rank 0 too, with no pretrained directory to read: an error on every rank.
    trainer_cls, _ = TRAINERS[KIND]

    class OnMeta(trainer_cls):  # type: ignore[misc, valid-type]
        def build_model(self) -> Any:
            with torch.device("meta"):
                return super().build_model()

    try:
        OnMeta(_config(base / "on_meta"))
        out["on_meta"] = "no error"
    except NotImplementedError as exc:
        out["on_meta"] = str(exc)
    return out


def _four_ranks(rank: int, world_size: int, base: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, parallel in LAYOUTS.items():
        counts: list[collections.Counter] = []
        run_trainer(KIND, _config(base / name, **parallel), setup=lambda t, c=counts: _counting(t, c))
        out[name] = {"curves": _curves(base / name), "counts": counts}
    run_trainer(KIND, _config(base / "resumed", resume=True, sp_size=4))
    out["resumed"] = {"curves": _curves(base / "resumed")}
    # The HSDP run's final checkpoint, loaded under HSDP and under plain FSDP: the same weights.
    loaded = {}
    for name in ("hsdp", "fsdp"):
        trainer = TRAINERS[KIND][0](_config(base / "hsdp", resume=True, **LAYOUTS[name]))
        loaded[name] = {k: v.full_tensor() for k, v in trainer.model.state_dict().items()}
        out[f"step_loaded_as_{name}"] = trainer.step
        trainer.metrics.close()
        trainer.loader.close()
    diffs = [float((loaded["hsdp"][k] - loaded["fsdp"][k]).abs().max()) for k in loaded["fsdp"]]
    out["hsdp_to_fsdp_max_diff"] = max(diffs)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, float]]:
    output_dir = tmp_path_factory.mktemp("one_process")
    run_trainer(KIND, _config(output_dir))
    return _curves(output_dir)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("two_ranks")
    return base, run_distributed(_two_ranks, 2, base, timeout_s=300)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory, two_ranks) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("four_ranks")
    shutil.copytree(two_ranks[0] / "written", base / "resumed")
    return run_distributed(_four_ranks, 4, base, timeout_s=600)[0]


def _assert_curves(got: dict[str, dict[int, float]], expected: dict[str, dict[int, float]], rel: float) -> None:
    for key in KEYS:
        assert sorted(got[key]) == list(range(1, STEPS + 1)), key
        for step, value in expected[key].items():
            assert got[key][step] == pytest.approx(value, rel=rel), f"{key} at step {step}: {got[key][step]} != {value}"


def test_a_node_local_checkpoint_directory_is_an_error_on_every_rank(two_ranks):
    _, results = two_ranks
    causes = [result["local"].rsplit("): ", 1)[-1] for result in results]  # each rank names its own directory
    assert causes[0] == causes[1] and causes[0].startswith("rank 1: cannot read the file"), causes
    for result in results:
        assert result["local"].startswith("checkpoint directory"), result["local"]
        assert "is not shared by every rank" in result["local"] and "rank 1: cannot read the file" in result["local"]
        assert "rank 0:" not in result["local"], "rank 0 reads its own probe"
        assert result["probe_left"] == [], "a shared directory passes and keeps no probe file"


def test_every_rank_resumes_rank_0s_checkpoint(two_ranks):
    _, results = two_ranks
    assert [result["resumed_step"] for result in results] == [2, 2]


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "fsdp"])
def test_hsdp_gradient_sync_and_recompute_train_like_plain_fsdp(four_ranks, reference, layout):
    _assert_curves(four_ranks[layout]["curves"], four_ranks["fsdp"]["curves"], rel=1e-5)
    _assert_curves(four_ranks[layout]["curves"], reference, rel=1e-4)


def test_collectives_per_step(four_ranks):
    """One loss all-reduce per step under every layout. Gradients are reduce-scattered per micro-batch (per step with
    gradient_sync=last_micro_batch); HSDP adds one replica all-reduce per FSDP unit per step."""
    for name, parallel in LAYOUTS.items():
        counts = four_ranks[name]["counts"]
        assert len(counts) == STEPS
        for step in counts:
            units = step["fsdp_units"]
            syncs = 1 if parallel.get("gradient_sync") == "last_micro_batch" else step["micro_batches"]
            assert step["micro_batches"] == (2 if parallel.get("sp_size") else 1), (name, step)
            assert step["loss"] == 1, (name, step)
            assert step["all_reduce/world"] == 2, (name, step)  # the loss and the grad-norm all-reduce
            assert step["reduce_scatter_single"] == units * syncs, (name, step)
            assert step["all_reduce/other"] == (units if parallel.get("dp_replicate") else 0), (name, step)


def test_a_checkpoint_from_two_ranks_resumes_at_four_with_dp_and_sp_changed(four_ranks, reference):
    _assert_curves(four_ranks["resumed"]["curves"], reference, rel=1e-4)


def test_an_hsdp_checkpoint_loads_under_plain_fsdp(four_ranks):
    assert four_ranks["step_loaded_as_hsdp"] == four_ranks["step_loaded_as_fsdp"] == STEPS
    assert four_ranks["hsdp_to_fsdp_max_diff"] == 0.0


@pytest.mark.parametrize("kind", ["vlm", "qwen2_vl"])
def test_a_model_built_on_rank_0_and_scattered_equals_a_whole_build(two_ranks, kind):
    """model.load_sharded: only rank 0 builds the model on the CPU (the others on meta), and after the scatter every
    weight and buffer, and the RNG state the build leaves, equal a build of the whole model on every rank."""
    _, results = two_ranks
    assert [result[kind]["devices"] for result in results] == [["cpu"], ["meta"]]
    assert [result[kind]["whole_devices"] for result in results] == [["cpu"], ["cpu"]]
    for result in results:
        if kind == "qwen2_vl":
            assert result[kind]["buffers"] > 0, "its rotary buffers (not saved) are compared too"
        assert result[kind]["max_diff"] == 0.0
        assert result[kind]["rng_equal"]


def test_a_model_on_meta_without_materialize_is_an_error_on_every_rank(two_ranks):
    _, results = two_ranks
    for result in results:
        assert result["on_meta"].endswith("returned a meta-device model: implement materialize"), result["on_meta"]
