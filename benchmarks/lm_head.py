"""make bench: peak memory and tokens/s of a training step, the LM head fused with its cross-entropy
(`model.fused_lm_head`) against the plain head (whole logits), at Qwen's vocabulary and a tiny decoder (Qwen2, hidden
64, two layers, untied embeddings) so the head dominates.

Each (vocabulary, tokens, head) runs in a fresh process on one thread: AdamW's state is made by a 16-token step, then
the peak RSS is reset (`/proc/self/clear_refs`) and steps of one packed row (samples of 512 tokens) are timed and their
peak read (`VmHWM`; on the CPU activations are part of the resident set). Growth: the peak over the same head's at
vocabulary 1,024, in units of one float32 [tokens, vocabulary] tensor (target <= 0.25 fused; the weights' own memory
does not shrink with the tokens, so it is set at 4,096 tokens and more). The tokens/s target's values are the fused /
plain ratios step by step. Where the plain head's logits would not fit in this machine's memory the row says so. Quick
mode: the growth of the fused head at 4,096 tokens (one step) and the tokens/s of both heads at 1,024 (two steps).
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

    # (tokens, fused, measure the growth, timed steps)
    runs = [(4096, True, True, 1), (1024, True, False, 2), (1024, False, False, 2)] if quick else []
    runs = runs or [(tokens, fused, True, 3) for tokens in (4096, 32768) for fused in (True, False)]
    rows, targets, speeds = [], [], {}
    for tokens, fused, growth, reps in runs:
        logits_mib, head = tokens * VOCAB * 4 / 2**20, "fused" if fused else "plain"
        if not fused and 3 * logits_mib > _available_mib():  # the plain head holds about three of them
            why = f"not run: needs about {3 * logits_mib / 1024:.0f} GiB, {_available_mib() / 1024:.0f} free"
            rows.append([tokens, head, logits_mib, why, None, None, None, None])
            continue
        big = _run(VOCAB, tokens, fused, reps)
        speeds[tokens, fused] = [tokens / seconds for seconds in big["seconds"]]
        base = _run(BASE_VOCAB, tokens, fused, 1)["peak_rss_mib"] if growth else None
        grown = big["peak_rss_mib"] - base if growth else None
        cells = [base, big["peak_rss_mib"], grown, grown / logits_mib if growth else None]
        rows.append([tokens, head, logits_mib, *cells, statistics.median(speeds[tokens, fused])])
        if fused and growth:
            name = f"fused growth / one float32 [{tokens:,}, vocab] tensor"
            targets.append(
                {"name": name, "op": "<=", "bound": TARGET_GROWTH, "unit": "", "values": [grown / logits_mib]}
            )
    for tokens in sorted({tokens for tokens, fused, _, _ in runs if not fused}):
        plain, note = speeds.get((tokens, False)), "the plain head does not fit in this machine's memory"
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
