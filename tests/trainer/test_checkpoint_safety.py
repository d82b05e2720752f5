"""Resuming from a checkpoint never runs code that the checkpoint carries.

Each file kind is replaced by a pickle whose loading creates a marker file; resume must not create it, must name the
file, and must fall back to the previous checkpoint with the same numbers as an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import pickletools
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.text_trainer import TextTrainer
from tests.dist_helpers import run_distributed
from tests.trainer.helpers import losses_by_step, ranked_run, run_trainer, tiny_config
from veomni_lite.trainer.checkpoint import CheckpointManager
from veomni_lite.trainer.safe_load import (
    DCP_METADATA_GLOBALS,
    TORCH_DTYPE_NAMES,
    RefusedFileError,
    SafeFileSystemReader,
    load_dcp_metadata,
    load_plain,
)

LR_ITEM = "optim.param_groups.0.lr"


class TouchOnLoad:
    """Unpickling this creates `marker` (what a malicious checkpoint could do with any callable)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An uninterrupted 6-step run, and a run stopped after step 4 with checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("safety")
    full = run_trainer("text", tiny_config("text", root / "full", max_steps=6))
    run_trainer("text", tiny_config("text", root / "stopped", max_steps=6, save_interval=2), stop_after=4)
    assert sorted(p.name for p in (root / "stopped" / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    return {"full": full, "stopped": root / "stopped"}


def copy_run(runs: dict[str, Any], tmp_path: Path, name: str = "run") -> tuple[Path, Path]:
    """A private copy of the stopped run: (run dir, its newest checkpoint)."""
    run_dir = tmp_path / name
    shutil.copytree(runs["stopped"], run_dir)
    return run_dir, run_dir / "checkpoints" / "step_00000004"


def tamper(checkpoint: Path, name: str, marker: Path) -> Path:
    """Replace `name` in `checkpoint` with a payload that creates `marker` when loaded unsafely; return its path."""
    path = checkpoint / name
    if name == ".metadata":
        path.write_bytes(pickle.dumps(TouchOnLoad(marker)))  # DCP's format: a plain pickle
    elif name == LR_ITEM:
        path = tamper_byte_item(checkpoint, name, marker)
    else:
        torch.save({"step": 4, "scheduler": TouchOnLoad(marker)}, path)
    return path


def tamper_byte_item(checkpoint: Path, fqn: str, marker: Path) -> Path:
    """Point DCP's non-tensor item `fqn` at a payload appended to its .distcp shard (the metadata stays clean)."""
    with (checkpoint / ".metadata").open("rb") as f:
        metadata = pickle.load(f)
    index = next(key for key in metadata.storage_data if key.fqn == fqn)
    info = metadata.storage_data[index]
    shard = checkpoint / info.relative_path
    buffer = io.BytesIO()
    torch.save(TouchOnLoad(marker), buffer)
    info.offset, info.length = shard.stat().st_size, len(buffer.getvalue())
    with shard.open("ab") as f:
        f.write(buffer.getvalue())
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    return shard


def resume(run_dir: Path) -> list[dict[str, Any]]:
    return run_trainer("text", tiny_config("text", run_dir, max_steps=6, save_interval=2, resume=True))


def assert_equal_to_uninterrupted(resumed: list[dict[str, Any]], full: list[dict[str, Any]]) -> None:
    assert [e["step"] for e in resumed] == [1, 2, 3, 4, 5, 6]
    for key in ("train/loss", "train/grad_norm", "train/lr"):
        expected, got = losses_by_step(full, key), losses_by_step(resumed, key)
        for step in expected:
            assert got[step] == pytest.approx(expected[step], rel=1e-6), (key, step)


def test_the_payloads_do_run_code_when_loaded_unsafely(runs, tmp_path):
    """Guards the other tests: each tampered file really runs code under the loaders used before issue 14."""
    _, checkpoint = copy_run(runs, tmp_path)
    for name in (".metadata", "trainer_state.pt", "rank_00000.pt"):
        marker = tmp_path / f"marker{name}"
        path = tamper(checkpoint, name, marker)
        if name == ".metadata":
            with path.open("rb") as f:
                pickle.load(f)  # what DCP's FileSystemReader does
        else:
            torch.load(path, weights_only=False)
        assert marker.exists(), name
    _, checkpoint = copy_run(runs, tmp_path, "byte_item")
    marker = tmp_path / "marker_item"
    tamper(checkpoint, LR_ITEM, marker)
    metadata = load_dcp_metadata(checkpoint / ".metadata")  # the metadata itself is clean
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == LR_ITEM)
    with (checkpoint / info.relative_path).open("rb") as f:
        f.seek(info.offset)
        torch.load(io.BytesIO(f.read(info.length)), weights_only=False)  # DCP's DefaultLoadPlanner.load_bytes
    assert marker.exists()


@pytest.mark.parametrize(
    ("name", "named_as"),
    [
        (".metadata", ".metadata: global pathlib.Path.touch is not a DCP metadata type"),
        ("trainer_state.pt", "trainer_state.pt: it needs getattr"),
        ("rank_00000.pt", "rank_00000.pt: it needs getattr"),
        (LR_ITEM, f"__0_0.distcp (the saved value {LR_ITEM!r}): it needs getattr"),
    ],
)
def test_a_tampered_file_runs_nothing_and_is_named(runs, tmp_path, caplog, name, named_as):
    run_dir, checkpoint = copy_run(runs, tmp_path)
    marker = tmp_path / "marker"
    tamper(checkpoint, name, marker)
    resumed = resume(run_dir)
    err = caplog.text
    assert not marker.exists(), "code from the checkpoint ran"
    assert f"checkpoint {checkpoint} is unusable" in err
    assert "RefusedFileError" in err and named_as in err, err
    assert_equal_to_uninterrupted(resumed, runs["full"])  # the previous (untouched) checkpoint resumed exactly


def test_a_raw_pickle_in_place_of_a_torch_file_is_refused(runs, tmp_path):
    _, checkpoint = copy_run(runs, tmp_path)
    marker = tmp_path / "marker"
    # Protocol 2, as torch.save writes (torch.load warns on others).
    (checkpoint / "trainer_state.pt").write_bytes(pickle.dumps(TouchOnLoad(marker), protocol=2))
    with pytest.raises(
        RefusedFileError, match=r"refused .*trainer_state\.pt: .*start fresh \(checkpoint\.resume false\)"
    ):
        load_plain(checkpoint / "trainer_state.pt")
    assert not marker.exists()


def test_dcp_reads_metadata_only_through_the_restricted_unpickler(runs, tmp_path):
    """Even past the pre-check (a file swapped in between), DCP's own metadata read refuses it."""
    _, checkpoint = copy_run(runs, tmp_path)
    marker = tmp_path / "marker"
    tamper(checkpoint, ".metadata", marker)
    with pytest.raises(RefusedFileError, match=r"refused .*step_00000004/\.metadata: global pathlib\.Path\.touch"):
        SafeFileSystemReader(checkpoint).read_metadata()
    assert not marker.exists()


def test_an_untouched_checkpoint_resumes_exactly_and_holds_only_plain_data(runs, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    run_dir, checkpoint = copy_run(runs, tmp_path)
    for name in ("trainer_state.pt", "rank_00000.pt"):
        with zipfile.ZipFile(checkpoint / name) as archive:
            data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
        used = {arg for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}
        assert used <= {"torch._utils _rebuild_tensor_v2", "torch ByteStorage", "collections OrderedDict"}, used
    seen = _metadata_globals(checkpoint / ".metadata")
    assert all(g in DCP_METADATA_GLOBALS or (g[0] == "torch" and g[1] in TORCH_DTYPE_NAMES) for g in seen), seen
    resumed = resume(run_dir)
    assert "unusable" not in caplog.text
    assert f"resumed from {checkpoint} at step 4" in caplog.text
    assert_equal_to_uninterrupted(resumed, runs["full"])


def test_saving_non_plain_state_is_refused_before_writing(tmp_path):
    trainer = TextTrainer(tiny_config("text", tmp_path, max_steps=1))
    try:
        manager = CheckpointManager(tmp_path / "checkpoints")
        with pytest.raises(TypeError, match=r"trainer_state\['extra'\]\[0\] is a pathlib\.PosixPath"):
            manager.save(1, trainer.model, trainer.optimizer, {"extra": [tmp_path]}, {})
        assert not manager.complete_checkpoints()
    finally:
        trainer.close()


def _metadata_globals(path: Path) -> set[tuple[str, str]]:
    seen: set[tuple[str, str]] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            seen.add((module, name))
            return super().find_class(module, name)

    with path.open("rb") as f:
        Recorder(f).load()
    return seen


# ---------------------------------------------------------------- two gloo ranks


def _resume_rank(rank: int, world_size: int, config: Any) -> tuple[int, str]:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        trainer = TextTrainer(config)
    step = trainer.step
    trainer.metrics.close()
    return step, stderr.getvalue()


@pytest.mark.slow
def test_a_tampered_rank_file_on_one_rank_makes_every_rank_fall_back(tmp_path):
    config = tiny_config("text", tmp_path, max_steps=4, save_interval=2)
    run_distributed(ranked_run, 2, "text", config)
    checkpoint = tmp_path / "checkpoints" / "step_00000004"
    marker = tmp_path / "marker"
    tamper(checkpoint, "rank_00001.pt", marker)
    results = run_distributed(_resume_rank, 2, tiny_config("text", tmp_path, max_steps=4, resume=True))
    assert not marker.exists(), "code from the checkpoint ran"
    assert [step for step, _ in results] == [2, 2], "every rank fell back to the previous checkpoint"
    assert f"rank 1: refused {checkpoint / 'rank_00001.pt'}" in results[0][1], results[0][1]
    assert _metadata_globals(checkpoint / ".metadata") <= DCP_METADATA_GLOBALS | {
        ("torch", name) for name in TORCH_DTYPE_NAMES
    }
