"""Reward vs step of several RL runs on one figure (e.g. `make train-ppo` beside `make train-rl-math`):

    python scripts/reward_compare.py OUT.png LABEL=RUN_DIR [LABEL=RUN_DIR ...]

Each run's metrics.jsonl gives `rl/reward/mean` (sampled, temperature 1) and `eval/accuracy` (greedy) by step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def series(run: Path, key: str) -> tuple[list[int], list[float]]:
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    points = [(e["step"], e[key]) for e in events if key in e]
    return [s for s, _ in points], [v for _, v in points]


def main(argv: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, runs = Path(argv[0]), [arg.split("=", 1) for arg in argv[1:]]
    figure, axes = plt.subplots(2, 1, figsize=(6.4, 6.0), sharex=True)
    for (label, run), color in zip(runs, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        for ax, key in zip(axes, ("rl/reward/mean", "eval/accuracy")):
            steps, values = series(Path(run), key)
            ax.plot(steps, values, marker="o", markersize=3, color=color, label=label)
            ax.set_ylabel(key)
    axes[0].legend()
    axes[1].set_xlabel("optimizer step")
    figure.tight_layout()
    figure.savefig(out, dpi=100)


if __name__ == "__main__":
    main(sys.argv[1:])
