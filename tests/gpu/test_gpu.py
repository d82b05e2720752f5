"""CUDA-only checks, run by `make test-gpu` (and by `make test`, where they skip without a GPU).

- The trainer's own step (`BaseTrainer.train_step`) makes zero host syncs per micro-batch under
  `torch.cuda.set_sync_debug_mode("warn")`: Qwen2 and Qwen2-VL SFT directories, packed with a token budget, the
  fused LM head, bf16, NCCL, SP 1 and (with 2 GPUs) SP 2, flash-attention varlen where flash-attn is installed,
  through tests/gpu/sync_audit.py, which also reports the step-end syncs and step times.
- `trainers/train_vlm.py` trains the tiny VLM on the GPU(s) (NCCL, bf16) and its loss falls.
- The fused LM head (bf16, Qwen's vocabulary) matches the plain head with no host sync in a quarter of the logits.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPO = Path(__file__).resolve().parents[2]
AUDIT = REPO / "tests" / "gpu" / "sync_audit.py"
RESULTS = REPO / "benchmarks" / "results" / "gpu"


def world_size() -> int:
    """One process per GPU, at most two."""
    return min(torch.cuda.device_count(), 2)


def torchrun(nproc: int, script: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    command += [str(script), *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(("kind", "sp"), [("qwen2", 1), ("qwen2", 2), ("qwen2_vl", 1), ("qwen2_vl", 2)])
def test_the_trainers_step_makes_no_host_sync_per_micro_batch(demo: Path, kind: str, sp: int) -> None:
    """`BaseTrainer.train_step` itself (packing, a token budget, the fused head, bf16, NCCL, flash-attention varlen
    where installed), through tests/gpu/sync_audit.py; its JSON lands in benchmarks/results/gpu/."""
    world = world_size()
    if world % sp:
        pytest.skip(f"SP {sp} needs {sp} GPUs, {world} visible")
    out = RESULTS / f"sync_audit_{kind}_world{world}_sp{sp}.json"
    done = torchrun(world, AUDIT, kind, str(demo), "--sp", str(sp), "--steps", "5", "--out", str(out))
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    result: dict[str, Any] = json.loads(out.read_text())
    assert result["audited"] and result["precision"] == "bf16" and result["trainer_step"] == 12
    assert result["syncs_per_micro_batch"] == 0, result["sync_sites"]
    print(
        f"\n{result['device']} x{world}, {kind}, SP {sp}, {result['attention']}: {result['micro_batches']} "
        f"micro-batches in {result['steps']} steps, 0 syncs per micro-batch, {result['syncs_per_step_end']:g} per "
        f"step end ({result['sync_sites']}); median step {result['step_time_s']['median'] * 1e3:.1f} ms"
    )


def test_trainer_trains_on_gpu(tmp_path: Path) -> None:
    world = world_size()
    overrides = ["--train.max_steps", "40", "--train.eval_interval", "0", "--train.output_dir", str(tmp_path)]
    overrides += ["--checkpoint.save_interval", "0", "--logging.log_interval", "10", "--logging.progress_bar", "false"]
    overrides += ["--logging.plot", "false", "--logging.tensorboard", "false"]
    done = torchrun(world, REPO / "trainers" / "train_vlm.py", str(REPO / "configs" / "vlm_tiny.yaml"), *overrides)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [event["train/loss"] for event in events if "train/loss" in event]
    assert len(losses) >= 2 and all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("kind", ["text", "qwen2_vl"])
def test_flash_attention_varlen_packed_equals_unpacked(kind: str) -> None:
    """flash_attention_2 over a packed row (host boundaries, no mask) gives each sample's logits unpacked (bf16)."""
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        pytest.skip("flash-attn is not installed")
    from tests.models.test_hf_models import IMAGE, PAD, make_lm, make_vl
    from tests.models.test_packing import packed_difference, text_samples, vl_samples
    from veomni_lite.data.collator import collate, pack
    from veomni_lite.loss_keys import ATTENTION_SEQUENCE_IDS
    from veomni_lite.models.qwen2_vl import collate_qwen2_vl

    model = (make_lm() if kind == "text" else make_vl()).to("cuda", torch.bfloat16)
    samples = text_samples() if kind == "text" else vl_samples()
    padded = collate(samples, pad_id=PAD) if kind == "text" else collate_qwen2_vl(samples, IMAGE, 2, PAD)
    packed = pack(samples, 8, PAD) if kind == "text" else collate_qwen2_vl(samples, IMAGE, 2, PAD, 8, packing=True)
    lengths = [s["input_ids"].numel() for s in samples]
    host = ("image_grid_thw", ATTENTION_SEQUENCE_IDS)

    def logits(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = {k: v if k in host else v.to("cuda") for k, v in batch.items() if "labels" not in k}
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
        with torch.no_grad():
            return model(**inputs)["logits"].float()

    unpacked = logits(padded)
    reference = torch.cat([unpacked[row, :n] for row, n in enumerate(lengths)])
    model.set_attn_implementation("flash_attention_2")
    difference = packed_difference(reference, logits(packed), lengths)
    print(f"\n{kind}: flash varlen packed vs sdpa unpacked, relative logit difference {difference:.2e}")
    assert difference < 3e-2


def test_fused_lm_head_on_gpu_matches_the_plain_head_without_host_syncs_in_a_quarter_of_the_logits():
    """bf16 at Qwen's vocabulary: the fused head's loss and gradients match the plain head's, its forward and
    backward make no host sync, and its extra peak memory is under a quarter of one float32 [tokens, vocab] tensor
    (the plain head, the control, takes more than one)."""
    import torch.nn.functional as F

    from veomni_lite.models.fused_ce import linear_cross_entropy
    from veomni_lite.models.heads import masked_mean_cross_entropy

    tokens, hidden, vocab = 4096, 64, 151_936
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(1, tokens, hidden, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), device="cuda", generator=g)
    labels[0, :100] = -100
    weights = torch.rand(1, tokens, device="cuda", generator=g)
    out = {}
    for fused in (True, False):
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.cuda.set_sync_debug_mode("error" if fused else 0)
        try:
            if fused:
                loss = linear_cross_entropy(h, w, labels, weights)
            else:
                loss = masked_mean_cross_entropy(F.linear(h, w), labels, weights)
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        out[fused] = (loss.detach().float(), h.grad.float(), w.grad.float(), torch.cuda.max_memory_allocated() - base)
    logits_bytes = tokens * vocab * 4
    print(f"\nfused head peak {out[True][3] / 2**20:.0f} MiB, plain {out[False][3] / 2**20:.0f} MiB over the inputs")
    assert out[True][3] < 0.25 * logits_bytes < logits_bytes < out[False][3]
    assert abs(float(out[True][0] - out[False][0])) <= 1e-3 * abs(float(out[False][0]))
    for got, want in zip(out[True][1:3], out[False][1:3]):
        assert float((got - want).abs().max()) <= 3e-2 * float(want.abs().max())
