"""make bench-gpu: one prepared script for one GPU, sized to finish in under 8 minutes on an H100 (no GPU: the same
code on tiny models on the CPU with `--dry-run`, which `make test` runs).

1. A Qwen3-30B-A3B-shaped MoE (its real widths: hidden 2,048, 128 experts of width 768, top-8, 32 query and 4 KV
   heads of 128, vocabulary 151,936; 2 of its 48 layers), bf16, one GPU, EP=1: our SFT trainer's step against
   transformers' own model (`moe_step.py`: its default `grouped_mm` experts and its aux loss, bf16 autocast over
   float32 weights, AdamW) on the same packed 4,096-token rows of 1,024-token samples, one side after the other (both
   models and their AdamW states would not fit at once), 3 warm-up and 10 timed steps each. Tokens/s, and MFU by
   active FLOPs: tokens/s x our `flops_per_token` (6 x the parameters a token runs, the routed experts at top-k / E,
   the input embedding left out, plus the attention term at 1,024 tokens) over the card's dense bf16 peak.
2. A dense Qwen3-1.7B-shaped SFT step (its config: 28 layers, hidden 2,048, MLP 6,144, tied 151,936-token
   embeddings), one packed 4,096-token row a step: our trainer alone, tokens/s and MFU.

Each runs as `torchrun --nproc_per_node 1` (our trainer's FSDP2 gives its bf16 compute there). The models are random
(written here, bf16 safetensors, with the arithmetic demo's tokenizer). Results: `benchmarks/results/gpu/bench.json`
(`--out`) and a printed table; `run_all.py` puts them on docs/benchmarks.md.

    python benchmarks/gpu.py [--dry-run] [--work-dir DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
JOBS = {  # name: (shape, dry-run shape, transformers' side too)
    "moe": ("qwen3_30b_a3b", "dry_run", True),
    "dense": ("qwen3_1_7b", "dry_run_dense", False),
}
STEPS, WARMUP = 10, 3
DRY_STEPS, DRY_WARMUP = 1, 1


def job_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per side of a `moe_step.measure` result: tokens/s and MFU from the median step."""
    tokens = statistics.median(result["step_tokens"])
    rows = []
    for side, seconds in result["seconds"].items():
        rate, peak = tokens / statistics.median(seconds), result["peak_flops"]
        mfu = rate * result["flops_per_token"] / peak if peak else None
        rows.append({"side": side, "tokens_per_s": rate, "mfu": mfu, "step_ms": statistics.median(seconds) * 1e3,
                     "steps": len(seconds)})  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny models on the CPU (no GPU needed)")
    parser.add_argument("--work-dir", type=Path, default=BENCH_DIR / "results" / "raw" / "gpu")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "gpu" / "bench.json")
    args = parser.parse_args()
    sys.path[:0] = [str(BENCH_DIR), str(REPO)]
    from harness import torchrun

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    report: dict[str, Any] = {
        "command": "make bench-gpu" + (" (dry run)" if args.dry_run else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit.strip(),
        "jobs": {},
    }
    steps, warmup = (DRY_STEPS, DRY_WARMUP) if args.dry_run else (STEPS, WARMUP)
    env = {"PYTHONPATH": f"{REPO}:{BENCH_DIR}"}
    for name, (shape, dry_shape, theirs) in JOBS.items():
        start = time.perf_counter()
        out = args.work_dir / f"{name}.json"
        run = ["--shape", dry_shape if args.dry_run else shape, "--work-dir", str(args.work_dir), "--out", str(out)]
        run += ["--steps", str(steps), "--warmup", str(warmup), "--sequential" if theirs else "--ours-only"]
        torchrun(BENCH_DIR / "moe_step.py", 1, run, timeout_s=900, env=env)
        result = json.loads(out.read_text())
        report["jobs"][name] = {"result": result, "rows": job_rows(result), "seconds": time.perf_counter() - start}
        report["device"] = result["device_name"]
        print(f"[bench-gpu] {name} ({result['shape']}, {result['device_name']}): {time.perf_counter() - start:.0f} s")
        for row in report["jobs"][name]["rows"]:
            mfu = "–" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
            print(f"  {row['side']:>6}: {row['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, {row['step_ms']:.1f} ms a step")
        if theirs:
            print(f"  first-step loss difference (relative): {result['loss_rel_diff']:.1e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"[bench-gpu] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
