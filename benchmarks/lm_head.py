"""make bench: peak memory and tokens/s of a training step, the LM head fused with its cross-entropy
(`model.fused_lm_head`) against the plain head (whole logits), at Qwen's vocabulary and a tiny decoder (Qwen2, hidden
64, two layers, untied embeddings) so the head dominates.

Each (vocabulary, tokens, head) runs in a fresh process on one thread: AdamW's state is made by a 16-token step, then
the peak RSS is reset (`/proc/self/clear_refs`) and steps of one packed row (samples of 512 tokens) are timed and their
peak read (`VmHWM`; on the CPU activations are part of the resident set). Growth: the peak over the same head's at
vocabulary 1,024, in units of one float32 [tokens, vocabulary] tensor (target <= 0.25 fused; the weights' own memory
does not shrink with the tokens, so it is set at 4,096 tokens and more). The tokens/s target's values are the fused /
plain ratios step by step. Where the plain head's logits would not fit in this machine's memory the row says so. Quick
mode: the fused head's growth at 4,096 tokens (one step); the plain head at 4,096 tokens takes about a minute a step.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VOCAB, BASE_VOCAB, SAMPLE = 151_936, 1_024, 512
TARGET_GROWTH, TARGET_SPEED = 0.25, 0.9  # fused growth / one [tokens, vocab] float32 tensor; fused / plain tokens/s


def one_step(vocab: int, tokens: int, fused: bool, reps: int = 3) -> dict[str, Any]:
    """This process: build, warm up, time `reps` steps; their seconds and the peak RSS in MiB."""
    import torch

    from veomni_lite.models.hf_causal_lm import HFCausalLM, hf_config_from_dict

    torch.manual_seed(0)
    settings = {"model_type": "qwen2", "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 176}
    settings |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    model = HFCausalLM.from_config(hf_config_from_dict(settings | {"max_position_embeddings": SAMPLE}))
    model.fused_lm_head = fused
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(n: int) -> None:
        positions = torch.arange(n)
        batch = {"input_ids": torch.randint(0, vocab, (1, n)), "labels": torch.randint(0, vocab, (1, n))}
        batch |= {"position_ids": (positions % SAMPLE)[None], "attention_sequence_ids": (positions // SAMPLE)[None]}
        model(**batch)["foundation_loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(16)
    Path("/proc/self/clear_refs").write_text("5")
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        step(tokens)
        seconds.append(time.perf_counter() - start)
    status = Path("/proc/self/status").read_text().splitlines()
    peak = next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmHWM:"))
    return {"seconds": seconds, "peak_rss_mib": peak}


def _run(vocab: int, tokens: int, fused: bool, reps: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--one", str(vocab), str(tokens), str(int(fused)), str(reps)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200, check=False)
    if done.returncode:
        raise RuntimeError(f"lm_head bench {vocab} x {tokens}, fused={fused}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _available_mib() -> float:
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    return next(int(line.split()[1]) / 1024 for line in meminfo if line.startswith("MemAvailable:"))


def block(work: Path, quick: bool) -> dict[str, Any]:
    """Per (tokens, head): peak RSS at both vocabularies and the growth (where measured), tokens/s; the targets."""
    from harness import prose

    runs = [(4096, True, 1)] if quick else [(tokens, fused, 3) for tokens in (4096, 32768) for fused in (True, False)]
    rows, targets, speeds = [], [], {}
    for tokens, fused, reps in runs:  # reps: timed steps
        logits_mib, head = tokens * VOCAB * 4 / 2**20, "fused" if fused else "plain"
        if not fused and 3 * logits_mib > _available_mib():  # the plain head holds about three of them
            why = f"not run: needs about {3 * logits_mib / 1024:.0f} GiB, {_available_mib() / 1024:.0f} free"
            rows.append([tokens, head, logits_mib, why, None, None, None, None])
            continue
        big, base = _run(VOCAB, tokens, fused, reps), _run(BASE_VOCAB, tokens, fused, 1)
        speeds[tokens, fused] = [tokens / seconds for seconds in big["seconds"]]
        grown = big["peak_rss_mib"] - base["peak_rss_mib"]
        cells = [base["peak_rss_mib"], big["peak_rss_mib"], grown, grown / logits_mib]
        rows.append([tokens, head, logits_mib, *cells, statistics.median(speeds[tokens, fused])])
        if fused:
            name, values = f"fused growth / one float32 [{tokens:,}, vocab] tensor", [grown / logits_mib]
            targets.append({"name": name, "op": "<=", "bound": TARGET_GROWTH, "unit": "", "values": values})
    for tokens in sorted({tokens for tokens, _, _ in runs}):
        plain = speeds.get((tokens, False))
        note = "quick mode: the full mode times the plain head" if quick else "the plain head does not fit in memory"
        values = [f / p for f, p in zip(speeds[tokens, True], plain)] if plain else []
        name = f"fused / plain tokens/s, {tokens:,} tokens"
        targets.append({"name": name, "op": ">=", "bound": TARGET_SPEED, "unit": "x", "values": values, "note": note})
    columns = ["tokens", "head", "one float32 [tokens, vocab] MiB", f"peak MiB, vocab {BASE_VOCAB:,}"]
    columns += [f"peak MiB, vocab {VOCAB:,}", "growth MiB", "growth / logits tensor", "tokens/s (median)"]
    table = {"columns": columns, "rows": rows}
    return {
        "title": "The LM head fused with its cross-entropy",
        "about": prose(__doc__),
        "tables": [table],
        "targets": targets,
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        vocab, tokens, fused, reps = (int(value) for value in sys.argv[2:6])
        print(json.dumps(one_step(vocab, tokens, bool(fused), reps)))
    else:
        print(json.dumps(block(Path("."), quick=False), indent=1))
