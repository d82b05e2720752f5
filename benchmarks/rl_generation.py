"""make bench: rollout generation tokens/s of the embedded engine (`TransformersEngine`) against transformers' own
`generate(do_sample=True)` on the same model and batch.

A randomly initialized Qwen2 (quick: hidden 256, 2 layers, vocabulary 4,096; full: hidden 512, 4 layers, vocabulary
32,768), float32, one process: prompts of 8 to 48 random tokens, 4 samples each, temperature 0.8, top-k 50, top-p 0.95,
no stop id (every row makes `max_new_tokens`, so both make the same tokens). transformers gets the engine's batch as the
engine lays it out (rows ordered by prompt length, left-padded) and its generation config reset to the defaults, so only
the sampler differs: theirs softmax and `torch.multinomial`, ours a seeded generator per row and Gumbel-max, with each
token's log-probability recorded (on CPU `torch.multinomial` over a large vocabulary is the slow part of theirs; on CUDA
ours launches a small kernel per row and step, not measured here). The two run interleaved, the order rotated each
repetition; the target is the median of the per-repetition ratios. Batch invariance: a few requests generated again one
at a time must give the same tokens as in the batch (rows differing, counted).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
QUICK = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2, "vocab_size": 4096}
FULL = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "vocab_size": 32768}
SIZES = {
    True: {"prompts": 8, "new": 32, "reps": 2, "alone": 1},
    False: {"prompts": 16, "new": 64, "reps": 3, "alone": 4},
}
SAMPLES, BATCH = 4, 64
TARGET_RATIO = 0.9


def build(model: dict[str, int]) -> Any:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024, **model)
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def measure(quick: bool) -> dict[str, Any]:
    """Per repetition the seconds of each; the batch's shape; the batch-invariance count."""
    from harness import interleaved_times
    from transformers import GenerationConfig

    from veomni_lite.engines.base import RolloutRequest, SamplingSettings
    from veomni_lite.engines.embedded import TransformersEngine

    size, model = SIZES[quick], QUICK if quick else FULL
    engine = TransformersEngine(build(model), torch.device("cpu"), batch_size=BATCH)
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(8, 49, (size["prompts"],), generator=generator).tolist()
    requests = [
        RolloutRequest(torch.randint(0, model["vocab_size"], (n,), generator=generator).tolist(), []) for n in lengths
    ]
    for index, request in enumerate(requests):
        request.seeds = [1000 * index + j for j in range(SAMPLES)]
    settings = SamplingSettings(max_new_tokens=size["new"], temperature=0.8, top_k=50, top_p=0.95)
    rows = sorted((len(r.prompt_ids), r.prompt_ids) for r in requests for _ in r.seeds)  # the engine's layout
    width = rows[-1][0]
    input_ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, (n, prompt) in enumerate(rows):
        input_ids[row, width - n :], mask[row, width - n :] = torch.tensor(prompt), 1
    theirs = GenerationConfig(
        max_new_tokens=size["new"], do_sample=True, temperature=0.8, top_k=50, top_p=0.95, pad_token_id=0
    )
    batched: dict[str, Any] = {}

    def ours(rep: int) -> None:
        batched["out"] = engine.generate(requests, settings)

    def transformers_generate(rep: int) -> None:
        engine.model.generate(input_ids=input_ids, attention_mask=mask, generation_config=theirs)

    steps = {"TransformersEngine": ours, "transformers generate(do_sample=True)": transformers_generate}
    interleaved_times(steps, 1)  # warm-up
    times = interleaved_times(steps, size["reps"])
    differing = 0
    for index in range(size["alone"]):
        alone = engine.generate([requests[index]], settings)[0]
        differing += sum(a.response_ids != b.response_ids for a, b in zip(alone, batched["out"][index]))
    return {
        "times": times,
        "rows": len(rows),
        "tokens": len(rows) * size["new"],
        "width": width,
        "checked": size["alone"] * SAMPLES,
        "differing": differing,
        "model": model,
    }


def block(work_dir: Path, quick: bool) -> dict[str, Any]:
    from harness import prose

    started = time.perf_counter()
    result = measure(quick)
    times, tokens = result["times"], result["tokens"]
    ours, theirs = times["TransformersEngine"], times["transformers generate(do_sample=True)"]
    rows = [[name, statistics.median(values), tokens / statistics.median(values)] for name, values in times.items()]
    ratios = [b / a for a, b in zip(ours, theirs)]  # tokens/s ratio = their seconds / ours
    about = prose(__doc__) + (
        f" This run: {result['rows']} rows x {tokens // result['rows']} new tokens, prompts left-padded to "
        f"{result['width']}, model {result['model']}, {len(ours)} repetitions after a warm-up; alone against batched: "
        f"{result['differing']} of {result['checked']} rows differ ({time.perf_counter() - started:.0f} s)."
    )
    return {
        "title": "RL rollout generation",
        "about": about,
        "tables": [{"columns": ["generator", "seconds (median)", "tokens/s"], "rows": rows}],
        "targets": [
            {
                "name": "TransformersEngine / transformers generate tokens/s",
                "op": ">=",
                "bound": TARGET_RATIO,
                "unit": "x",
                "values": ratios,
            },
            {
                "name": f"rows whose tokens differ alone and batched (of {result['checked']})",
                "op": "<=",
                "bound": 0,
                "unit": "",
                "values": [result["differing"]],
            },
        ],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small model and batch (under 30 s)")
    parser.add_argument("--json", action="store_true", help="print the block's dict instead of the table")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
    out = block(REPO / "benchmarks" / "results" / "raw" / "rl_generation", args.quick)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        from report import PASSES, table

        print(out["about"] + "\n")
        print(table(out["tables"][0]["columns"], out["tables"][0]["rows"]))
        for target in out["targets"]:
            value = statistics.median(target["values"])
            verdict = "met" if PASSES[target["op"]](value, target["bound"]) else "missed"
            values, bound = [round(v, 3) for v in target["values"]], f"{target['op']} {target['bound']}{target['unit']}"
            print(f"{target['name']}: {value:.3g}{target['unit']} (each run {values}; {bound}: {verdict})")
