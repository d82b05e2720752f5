"""The torchrun entry points as a user runs them: outputs, config errors, SIGTERM and resume."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
SMALL = ["--model.hidden_size", "32", "--model.intermediate_size", "64", "--data.num_samples", "512"]


def torchrun(entry: str, config: str, nproc: int, *args: str) -> list[str]:
    return [*TORCHRUN, "--nproc_per_node", str(nproc), f"trainers/{entry}", f"configs/{config}", *SMALL, *args]


ENV = dict(os.environ, OMP_NUM_THREADS="1")


def run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)


def sigterm_when(command: list[str], ready: Callable[[], bool], timeout: float = 120) -> tuple[int, str]:
    """Start `command`, send it SIGTERM as soon as `ready()` (or after `timeout`); its (exit code, stderr)."""
    proc = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not ready():
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=timeout)
    return proc.returncode, stderr


def events(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("entry", "config", "loss_keys"),
    [
        ("train_vlm.py", "vlm_tiny.yaml", ["train/foundation_loss", "train/image_decoder_loss"]),
        ("train_text.py", "text_tiny.yaml", ["train/foundation_loss"]),
    ],
)
def test_entry_point_writes_every_output(tmp_path, entry, config, loss_keys):
    out = tmp_path / "run"
    args = ["--train.max_steps", "8", "--train.log_interval", "3", "--train.eval_interval", "4"]
    result = run(torchrun(entry, config, 2, *args, "--train.output_dir", str(out)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Outputs in {out}" in result.stdout
    logged = events(out)
    train_steps = [e["step"] for e in logged if "train/loss" in e]
    assert train_steps == [3, 6, 8]
    for key in ["train/loss", *loss_keys, "train/grad_norm", "train/lr", "train/tokens_per_s"]:
        assert key in logged[-1] or key in logged[-2], key
    assert any("eval/loss" in e for e in logged)
    assert (out / "loss_curve.png").stat().st_size > 1000
    assert any((out / "tensorboard").iterdir())
    assert (out / "checkpoints" / "step_00000008" / ".metadata").is_file()
    assert "train:" in (out / "config.yaml").read_text()


@pytest.mark.slow
def test_config_error_exits_before_any_process_group(tmp_path):
    result = run(torchrun("train_vlm.py", "vlm_tiny.yaml", 2, "--train.global_batch_size", "6"))
    assert result.returncode != 0
    assert "train.global_batch_size (6) is not divisible by train.micro_batch_size (8) x dp size (2" in result.stderr


@pytest.mark.slow
def test_a_bad_row_on_two_ranks_is_said_once_and_last(demo, tmp_path):
    """Through `python -m veomni_lite.torchrun` (what the make targets run) the cause is the last line, once, with
    exit code 2; plain torchrun's report names it once, as its root cause (its last line is its own border)."""
    lines = (demo / "help" / "train.jsonl").read_text().splitlines()[:64]
    lines[5] = lines[5][:-1]  # no closing brace: in rank 0's share of the rows
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    cause = f"data error: {bad}, row 5 (0-based): malformed JSON, column {len(lines[5]) + 1} (the end of the line): "
    cause += "Expecting ',' delimiter"
    args = ["--nproc_per_node", "2", "trainers/train_sft.py", "configs/sft_help.yaml", "--data.train_path", str(bad)]
    args += ["--model.pretrained_dir", str(demo / "models" / "qwen2_help"), "--train.output_dir", str(tmp_path / "o")]
    ours = [sys.executable, "-m", "veomni_lite.torchrun", "--standalone", *args]
    done = subprocess.run(ours, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = done.stdout.rstrip().splitlines()
    assert done.returncode == 2, done.stdout[-3000:]
    assert output[-1] == cause and done.stdout.count(cause) == 1, done.stdout[-3000:]
    assert output[-2] == (
        "[veomni_lite] trainers/train_sft.py failed (rank 0: exit code 2, rank 1: exit code 2). The cause, from rank 0:"
    )
    plain = subprocess.run(
        [*TORCHRUN, *args], cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert plain.returncode == 1 and plain.stdout.count(cause) == 1, plain.stdout[-3000:]
    root = plain.stdout[plain.stdout.index("Root Cause (first observed failure):") :]
    assert "rank      : 0 (local_rank: 0)" in root and f"traceback : {cause}" in root
    assert "stopped on the same error as local rank 0" in plain.stdout, "rank 1 is in the report, without the cause"


@pytest.mark.slow
def test_sigterm_saves_flushes_and_resume_matches_an_uninterrupted_run(tmp_path):
    common = ["--train.max_steps", "40", "--train.log_interval", "1", "--train.save_interval", "0"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    reference = run(torchrun("train_vlm.py", "vlm_tiny.yaml", 2, *common, "--train.output_dir", str(full)))
    assert reference.returncode == 0, reference.stderr[-3000:]

    def five_lines() -> bool:
        return (cut / "metrics.jsonl").exists() and len((cut / "metrics.jsonl").read_text().splitlines()) >= 5

    returncode, stderr = sigterm_when(
        torchrun("train_vlm.py", "vlm_tiny.yaml", 2, *common, "--train.output_dir", str(cut)), five_lines
    )
    assert returncode != 0, "an interrupted run exits non-zero"
    checkpoints = sorted((cut / "checkpoints").glob("step_*"))
    assert checkpoints, stderr[-3000:]
    stopped_at = int(checkpoints[-1].name.split("_")[1])
    assert 5 <= stopped_at < 40
    assert [e["step"] for e in events(cut)] == list(range(1, stopped_at + 1)), "every finished step was logged"

    resumed = run(
        torchrun("train_vlm.py", "vlm_tiny.yaml", 2, *common, "--train.output_dir", str(cut), "--train.resume", "true")
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got, expected = events(cut), events(full)
    assert [e["step"] for e in got] == [e["step"] for e in expected]
    for a, b in zip(got, expected):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5), a["step"]


@pytest.mark.slow
def test_sigterm_right_after_a_checkpoint_counts_every_window_once(tmp_path):
    """The reported case: save every 2, log every 3, 7 steps, SIGTERM as soon as checkpoints/step_00000004 appears."""
    common = ["--train.max_steps", "7", "--logging.log_interval", "3", "--checkpoint.save_interval", "2"]
    common += ["--train.global_batch_size", "16", "--logging.async_step_end", "true"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    reference = run(torchrun("train_vlm.py", "vlm_tiny.yaml", 2, *common, "--train.output_dir", str(full)))
    assert reference.returncode == 0, reference.stderr[-3000:]
    command = torchrun("train_vlm.py", "vlm_tiny.yaml", 2, *common, "--train.output_dir", str(cut))
    sigterm_when(command, (cut / "checkpoints" / "step_00000004").exists)
    resume = ["--train.output_dir", str(cut), "--checkpoint.resume", "true"]
    resumed = run(torchrun("train_vlm.py", "vlm_tiny.yaml", 2, *common, *resume))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got, expected = events(cut), events(full)
    steps = [e["step"] for e in got]
    assert steps == sorted(set(steps)), steps
    assert sum(e.get("train/tokens", 0) for e in got) == sum(e.get("train/tokens", 0) for e in expected)
    assert got[-1]["train/tokens_seen"] == expected[-1]["train/tokens_seen"]


FAULT_IN_A_FORWARD = '''"""A trainer entry point whose rank 1 raises in its third embedding forward."""
import os, runpy, sys
import torch
if os.environ["RANK"] == "1":
    calls, original = [], torch.nn.Embedding.forward
    def forward(self, input):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of memory on rank 1: tried to allocate 2.00 GiB")
        return original(self, input)
    torch.nn.Embedding.forward = forward
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


@pytest.mark.slow
def test_an_error_inside_a_forward_on_one_rank_ends_the_run_with_its_cause_not_a_hang(tmp_path):
    """Issue 48: an error no agreement can see first (an out-of-memory inside the model's forward on rank 1, while
    rank 0 waits in that forward's all-gather) ends the run through the launcher, which stops the other ranks when one
    exits: the cause is the last line, from rank 1, well within `run`'s limit and the 300 s collective timeout."""
    script = tmp_path / "fault.py"
    script.write_text(FAULT_IN_A_FORWARD)
    args = ["--train.max_steps", "6", "--train.output_dir", str(tmp_path / "o"), "--logging.progress_bar", "false"]
    command = [sys.executable, "-m", "veomni_lite.torchrun", "--standalone", "--nproc_per_node", "2", str(script)]
    command += ["trainers/train_text.py", "configs/text_tiny.yaml", *SMALL, *args]
    done = subprocess.run(command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120)  # fmt: skip
    output = done.stdout.rstrip().splitlines()
    assert done.returncode == 1, done.stdout[-3000:]
    assert output[-1] == "RuntimeError: out of memory on rank 1: tried to allocate 2.00 GiB", done.stdout[-3000:]
    # rank 0 is stopped by the launcher (SIGTERM), or, if gloo sees its peer gone first, fails on the lost peer
    ranks = r"\(rank 0: (signal SIGTERM|exit code 1), rank 1: exit code 1\)\. The cause, from rank 1:"
    assert re.search(re.escape(f"{script} failed ") + ranks, done.stdout), done.stdout[-3000:]
