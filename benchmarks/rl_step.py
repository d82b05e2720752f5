"""make bench: an RL step through the real trainer, 2 gloo ranks: the share spent generating, the reference's memory.

GRPO on the arithmetic prompts of `examples/rl_math.py` (16 prompts x 8 samples, up to 16 new tokens, 2 optimizer
steps per rollout batch, `rl.kl_coef` 0.05 so a reference is kept) on a Qwen2 of hidden size 512, 4 layers (quick: 256,
2 layers) with the demo's tokenizer, trained whole or with LoRA rank 8. Per variant: the seconds of a rollout batch
(its generation by the embedded engine, weight sync included, and its two optimizer steps with the old and reference
log-probabilities), the share spent generating, and the reference's bytes per rank against the whole model's: the
reference is the initial weights' FSDP2 shards (about 1/dp of a copy), and nothing under LoRA (the base with the
adapters off).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODEL = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8}
QUICK_MODEL = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2, "num_attention_heads": 8}
LORA = "{rank: 8, alpha: 16}"
TARGET_REFERENCE_SHARE = 0.55  # the reference per rank over a whole copy, at most, on 2 ranks


def _worker(work_dir: Path, model_dir: Path, variant: str, batches: int, out: Path, vllm_url: str = "") -> None:
    """One variant's rollout batches through `RLTrainer` (`rl_vllm.py` runs the vllm-* ones on its server's URL)."""
    import torch.distributed as dist
    from harness import model_bytes

    from veomni_lite.config import load_config
    from veomni_lite.rl.config import RLConfig
    from veomni_lite.rl.trainer import RLTrainer

    if os.environ.get("BENCH_CPUS"):  # rl_vllm.py keeps the server's core apart
        os.sched_setaffinity(0, {int(cpu) for cpu in os.environ["BENCH_CPUS"].split(",")})
    data = work_dir / "data"
    args = [
        "--model.arch", "auto", "--model.pretrained_dir", str(model_dir), "--data.format", "messages",
        "--data.train_path", str(data / "rl_train.jsonl"), "--data.max_seq_len", "96",
        "--rl.prompts_per_step", "16", "--rl.num_generations", "8", "--rl.max_new_tokens", "16",
        "--rl.rewards", "[{name: correct, function: math}]", "--rl.kl_coef", "0.05",
        "--train.micro_batch_size", "32", "--train.global_batch_size", "64", "--train.max_steps", "1000",
        "--train.output_dir", str(work_dir / f"run_{variant}"), "--checkpoint.save_interval", "0",
        "--logging.log_interval", "1000", "--logging.progress_bar", "false", "--logging.tensorboard", "false",
        "--logging.plot", "false", "--model.lora", LORA if variant == "lora" else "{}",
    ]  # fmt: skip
    if variant.startswith("vllm"):
        args += ["--rl.engine", "vllm", "--rl.vllm", f"{{url: {vllm_url}, request_timeout_s: 900}}",
                 "--rl.importance_sampling", "token",
                 "--rl.async_steps", str(int(variant == "vllm-async"))]  # fmt: skip
    config = load_config(None, args, world_size=int(os.environ["WORLD_SIZE"]), sections={"rl": RLConfig})
    trainer = RLTrainer(config)
    rows = []
    for _ in range(batches + 1):  # the first batch warms up
        dist.barrier()
        start = time.perf_counter()
        generate = 0.0
        for _ in range(trainer.loader.steps_per_rollout):
            micro_batches = trainer.loader.next_step()
            made = trainer.loader.made  # the rollout batch this step made, if any (`RolloutPipeline.make`)
            generate += made.generate_s if made is not None else 0.0
            trainer.train_step(micro_batches)
        rows.append({"seconds": time.perf_counter() - start, "generate_s": generate})
    whole = model_bytes(trainer.model)
    mine = {"batches": rows[1:], "reference_bytes": trainer.reference.bytes}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"ranks": gathered, "whole_bytes": whole}))
    trainer.metrics.finish(trainer.step, 0)
    trainer.close()


def block(work_dir: Path, quick: bool) -> dict[str, Any]:
    """Per variant: the median rollout-batch seconds, the share generating, the reference's MiB per rank."""
    from harness import math_model, prose, torchrun

    model, batches = (QUICK_MODEL, 1) if quick else (MODEL, 4)
    work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = math_model(work_dir, model)
    variants = {}
    for variant in ("full", "lora"):
        out = work_dir / f"{variant}.json"
        args = ["--worker", variant, "--work-dir", str(work_dir), "--model-dir", str(model_dir)]
        torchrun(Path(__file__), 2, [*args, "--batches", str(batches), "--out", str(out)], 900, {})
        result = json.loads(out.read_text())
        ranks = result["ranks"]
        seconds = [max(r["batches"][i]["seconds"] for r in ranks) for i in range(batches)]
        shares = [r["batches"][i]["generate_s"] / r["batches"][i]["seconds"] for r in ranks for i in range(batches)]
        reference = max(r["reference_bytes"] for r in ranks)
        variants[variant] = {"seconds": statistics.median(seconds), "share": statistics.median(shares),
                             "reference": reference, "whole": result["whole_bytes"]}  # fmt: skip
    rows = [
        [name, v["seconds"], v["share"] * 100, v["reference"] / 2**20, v["whole"] / 2**20, v["reference"] / v["whole"]]
        for name, v in variants.items()
    ]
    columns = ["variant", "rollout batch s (median)", "generating %", "reference MiB per rank", "model MiB (whole)",
               "reference / whole"]  # fmt: skip
    return {
        "title": "An RL step: generation share and the reference's memory",
        "about": prose(__doc__) + f" {batches} timed rollout batches after a warm-up batch; LoRA: `{LORA}`.",
        "tables": [{"columns": columns, "rows": rows}],
        "targets": [
            {"name": "reference / whole model per rank (full, 2 ranks)", "op": "<=", "bound": TARGET_REFERENCE_SHARE,
             "unit": "", "values": [variants["full"]["reference"] / variants["full"]["whole"]]},
            {"name": "reference bytes per rank under LoRA", "op": "<=", "bound": 0, "unit": "",
             "values": [variants["lora"]["reference"]]},
        ],
    }  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["full", "lora", "vllm-sync", "vllm-async"])
    parser.add_argument("--vllm-url", default="")
    parser.add_argument("--work-dir", type=Path, default=REPO / "benchmarks" / "results" / "raw" / "rl_step")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
    if args.worker:
        _worker(args.work_dir, args.model_dir, args.worker, args.batches, args.out, args.vllm_url)
    else:
        print(json.dumps(block(args.work_dir, quick=args.quick), indent=1))
