"""Multi-node launch as the README documents it: two torchrun agents (through `python -m veomni_lite.torchrun`, the
launcher the docs use) rendezvous over c10d on 127.0.0.1, as two nodes would (one process each, DP=2), and train with
the same per-step losses as one standalone 2-process run."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.e2e.test_entry_points import ENV, REPO, SMALL, events, run

ARGS = [
    "--train.max_steps", "4",
    "--logging.log_interval", "1",
    "--train.eval_interval", "0",
    "--checkpoint.save_interval", "0",
]  # fmt: skip
JOB = ["trainers/train_vlm.py", "configs/vlm_tiny.yaml", *SMALL, *ARGS]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_agents_over_c10d_train_like_one_standalone_run(tmp_path):
    standalone = run([sys.executable, "-m", "veomni_lite.torchrun", "--standalone", "--nproc_per_node", "2",
                      *JOB, "--train.output_dir", str(tmp_path / "one")])  # fmt: skip
    assert standalone.returncode == 0, standalone.stderr[-3000:]
    port = free_port()
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "veomni_lite.torchrun",
                "--nnodes",
                "2",
                "--nproc_per_node",
                "1",
                "--node_rank",
                str(node),
                "--rdzv_backend",
                "c10d",
                "--rdzv_endpoint",
                f"127.0.0.1:{port}",
                "--rdzv_id",
                "veomni-test",
                *JOB,
                "--train.output_dir",
                str(tmp_path / "two"),
            ],
            cwd=REPO,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for node in range(2)
    ]
    outputs = [agent.communicate(timeout=300) for agent in agents]
    for agent, (_, stderr) in zip(agents, outputs):
        assert agent.returncode == 0, stderr[-3000:]
    one = {e["step"]: e["train/loss"] for e in events(tmp_path / "one") if "train/loss" in e}
    two = {e["step"]: e["train/loss"] for e in events(tmp_path / "two") if "train/loss" in e}
    print(f"\nper-step train/loss, standalone {one}, two agents {two}")
    assert one.keys() == two.keys() == {1, 2, 3, 4}
    assert all(two[step] == pytest.approx(one[step], rel=1e-6) for step in one)
