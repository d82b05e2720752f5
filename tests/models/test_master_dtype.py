"""A bf16 release trains on float32 masters: a directory saved in bfloat16 (as Qwen and Llama releases are) loads
with float32 parameters, gradients and AdamW moments, whole in one process, read shard by shard on 2 ranks, or
loaded by rank 0 and scattered; an update far smaller than a bf16 step is kept, where bf16 masters
(`parallel.master_dtype: bf16`, the control) round most of it away; the checkpoint holds float32; the export writes
the directory's bf16 by default and `--dtype float32` on request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from examples.sft_demo import write_help, write_text_model
from tests.data.test_sft_training import help_args, train
from tests.dist_helpers import run_distributed
from veomni_lite.trainer.sft import SFTTrainer

UPDATE = [
    "--train.max_steps", "3",
    "--train.eval_interval", "0",
    "--optim.lr", "1e-6",
    "--optim.warmup_steps", "0",
    "--optim.schedule", "constant",
    "--optim.weight_decay", "0.0",
    "--optim.max_grad_norm", "0",
    "--checkpoint.save_interval", "0",
]  # fmt: skip


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """The help pages and a tiny Qwen2 directory stored in bfloat16, in the layout `help_args` expects."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("bf16")
    directory = out / "models" / "qwen2_help"
    write_text_model(directory, write_help(out / "help"))
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(str(directory), safe_serialization=True)
    assert json.loads((directory / "config.json").read_text())["dtype"] == "bfloat16"
    return out


def stored_weights(demo: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(demo / "models" / "qwen2_help" / "model.safetensors"))


def changed_fraction(trainer: SFTTrainer, stored: dict[str, torch.Tensor]) -> float:
    """The share of the weight matrices' elements that differ from the directory's after training."""
    changed = total = 0
    for name, param in trainer.model.hf_model.named_parameters():
        if param.dim() == 2 and "embed" not in name:
            changed += int((param.detach().float() != stored[name].float()).sum())
            total += param.numel()
    return changed / total


def checkpoint_dtypes(output_dir: Path) -> set[torch.dtype]:
    """Every dtype of the model and optimizer tensors in the run's last checkpoint (from DCP's metadata)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    last = sorted((output_dir / "checkpoints").glob("step_*"))[-1]
    metadata = dcp.FileSystemReader(str(last)).read_metadata().state_dict_metadata
    dtypes = {
        entry.properties.dtype
        for key, entry in metadata.items()
        if isinstance(entry, TensorStorageMetadata) and not key.endswith(".step")
    }
    assert any(key.startswith("optim.state") for key in metadata), sorted(metadata)[:5]
    return dtypes


def _train(demo: Path, out: Path, *extra: str, world_size: int = 1) -> SFTTrainer:
    return train("sft_help.yaml", help_args(demo, out, *UPDATE, *extra), world_size)


def test_a_bf16_directory_trains_float32_masters_that_keep_a_small_update(demo, tmp_path):
    stored = stored_weights(demo)
    trainer = _train(demo, tmp_path / "fp32")
    params = list(trainer.model.parameters())
    assert {p.dtype for p in params} == {torch.float32}
    moments = [s[k] for s in trainer.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert moments and {m.dtype for m in moments} == {torch.float32}
    assert checkpoint_dtypes(tmp_path / "fp32") == {torch.float32}
    kept = changed_fraction(trainer, stored)

    control = _train(demo, tmp_path / "bf16", "--parallel.master_dtype", "bf16")
    assert {p.dtype for p in control.model.parameters()} == {torch.bfloat16}
    lost = changed_fraction(control, stored)
    print(f"\nlr 1e-6, 3 steps, weight-matrix elements changed: float32 masters {kept:.4f}, bf16 masters {lost:.4f}")
    assert kept > 0.99
    assert lost < 0.1


def test_the_export_writes_the_directorys_bf16_unless_told_otherwise(demo, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from veomni_lite.export import main

    trainer = _train(demo, tmp_path / "run")
    for flag, dtype in (([], torch.bfloat16), (["--dtype", "float32"], torch.float32)):
        target = tmp_path / f"export_{dtype}"
        assert main([str(tmp_path / "run"), str(target), *flag]) == 0
        assert json.loads((target / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
        with safe_open(str(target / "model.safetensors"), framework="pt") as handle:
            assert {handle.get_tensor(key).dtype for key in handle.keys()} == {dtype}  # noqa: SIM118 - safe_open is no dict
        loaded = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).state_dict()
        for name, param in trainer.model.hf_model.state_dict().items():
            assert torch.equal(loaded[name], param.to(dtype).float()), (dtype, name)


def _dtypes_on_two_ranks(rank: int, world_size: int, demo: Path, out: Path) -> dict[str, list[str]]:
    from veomni_lite.trainer import base

    found = {}
    loadable = base.loadable
    for way in ("sharded", "scattered"):
        base.loadable = (lambda model, directory: False) if way == "scattered" else loadable
        try:
            trainer = _train(demo, out / way, world_size=world_size)
        finally:
            base.loadable = loadable
        moments = [s[k] for s in trainer.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
        found[way] = sorted({str(t.dtype) for t in (*trainer.model.parameters(), *moments)})
        trainer.loader.close()
    return found


@pytest.mark.slow
def test_two_ranks_keep_float32_masters_read_per_rank_or_scattered(demo, tmp_path):
    for found in run_distributed(_dtypes_on_two_ranks, 2, demo, tmp_path, timeout_s=600):
        assert found == {"sharded": ["torch.float32"], "scattered": ["torch.float32"]}
    for way in ("sharded", "scattered"):
        assert checkpoint_dtypes(tmp_path / way) == {torch.float32}
