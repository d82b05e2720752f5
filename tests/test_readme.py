"""The README's snippets (and the harness script on docs/loss.md) run as written and do what the text says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

README = Path(__file__).resolve().parents[1] / "README.md"
LOSS_DOC = README.parent / "docs" / "loss.md"  # the README links there for the harness's script


def python_block(heading: str, page: Path = README) -> str:
    """The first python code block after `heading` on `page`."""
    text = page.read_text()
    return re.search(r"```python\n(.*?)```", text[text.index(heading) :], re.S).group(1)


def test_the_loss_snippet_trains_on_the_exact_token_mean_of_the_step(monkeypatch):
    namespace: dict = {}
    grads: list[torch.Tensor] = []
    original_step = torch.optim.AdamW.step

    def capture_then_step(self, *args, **kwargs):
        grads.extend(p.grad.clone() for p in namespace["model"].parameters())
        return original_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", capture_then_step)
    exec(compile(python_block("### Use the loss module in a loop of your own"), "README.md", "exec"), namespace)
    model, batches = namespace["model"], namespace["micro_batches"]
    assert len(grads) == len(list(model.parameters()))

    torch.manual_seed(0)  # the snippet's initial weights: it seeds, then builds the model before drawing any batch
    reference = type(model)(model.config)
    total = sum(
        F.cross_entropy(
            reference(input_ids=b["input_ids"]).logits.flatten(0, 1), b["labels"].flatten(), reduction="sum"
        )
        for b in batches
    )
    count = sum(int((b["labels"] != -100).sum()) for b in batches)
    (total / count).backward()
    for p, g in zip(reference.parameters(), grads):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_the_split_invariance_script_runs_and_finds_the_heads_exact(tmp_path):
    script = tmp_path / "check_my_head.py"
    script.write_text(python_block("### Prove your own head is exact", LOSS_DOC))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    for layout in ("dp1xsp1/mbs1", "dp2xsp1/mbs2", "dp1xsp2/mbs4", "dp2xsp2/mbs2"):
        assert layout in done.stdout
    assert "seq-mean-token-mean" in done.stdout


def broken_links(page: Path) -> list[str]:
    """The relative links of a markdown page whose file does not exist (anchors and web addresses left out)."""
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    return [t for t in targets if not t.startswith(("http://", "https://")) and not (page.parent / t).exists()]


def test_the_readme_and_the_docs_pages_link_to_files_that_exist(tmp_path):
    pages = [README, *sorted((README.parent / "docs").glob("*.md"))]
    assert len(pages) > 5
    assert {page.name: broken_links(page) for page in pages} == {page.name: [] for page in pages}
    assert "(docs/loss.md)" in README.read_text(), "the README links the depth"
    # negative control: a link to a missing page is found
    page = tmp_path / "page.md"
    page.write_text("see [a](missing.md), [b](https://example.com) and [c](page.md#top)")
    assert broken_links(page) == ["missing.md"]


def test_the_quick_start_commands_are_makefile_targets():
    quick_start = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    targets = set(re.findall(r"^([a-z-]+):", (README.parent / "Makefile").read_text(), re.M))
    commands = re.findall(r"^make ([a-z-]+)", quick_start, re.M)
    assert {"train", "train-text", "train-sft", "test", "quality", "bench"} <= set(commands)
    demos = set(commands) | set(re.findall(r"; make ([a-z-]+)", quick_start))
    assert {"train-lora", "train-rl", "train-rl-math", "train-dpo", "train-rm", "train-ppo", "train-agent"} <= demos, (
        "every post-training demo"
    )
    assert demos <= targets, demos - targets


def test_the_readme_stays_a_ten_minute_page():
    """At most 400 lines: the depth lives under docs/, which the README links."""
    assert len(README.read_text().splitlines()) <= 400


# plain torchrun launched as a command (`torchrun --...`, `.venv/bin/torchrun x.py`, `python -m torch.distributed.run`),
# not prose about it ("one torchrun agent per node") nor the launcher (`python -m veomni_lite.torchrun`)
BARE_TORCHRUN = re.compile(
    r"(?:^|[\s;&|(`'\"])(?:\S*/)?torchrun[ \t]+(?:--?\w|\\|\$|[\w./-]+\.py\b)|-m[ \t]+torch\.distributed\.run\b", re.M
)


def bare_torchrun_launches(text: str) -> list[str]:
    """The lines of `text` that launch plain torchrun rather than `python -m veomni_lite.torchrun`."""
    return [line.strip() for line in text.splitlines() if BARE_TORCHRUN.search(line)]


def test_every_launch_line_in_the_docs_goes_through_the_launcher_that_ends_with_the_cause():
    """A failed run under plain torchrun ends with its 40-line report, the cause buried above it; the launcher ends
    with the cause (veomni_lite/torchrun.py). Every page a user copies a command from launches through it."""
    root = README.parent
    pages = [README, *sorted((root / "docs").glob("*.md")), root / "Makefile", *sorted((root / "scripts").iterdir())]
    pages += sorted((root / "trainers").glob("*.py"))  # each entry point's usage line
    found = {str(page.relative_to(root)): bare_torchrun_launches(page.read_text()) for page in pages if page.is_file()}
    assert {page: lines for page, lines in found.items() if lines} == {}
    launches = [line for page in pages if page.suffix == ".md" for line in page.read_text().splitlines()]
    assert sum("python -m veomni_lite.torchrun --" in line for line in launches) >= 8
    # negative controls: each way of launching plain torchrun is found; prose and the launcher are not
    bare = [
        "torchrun --standalone --nproc_per_node 2 trainers/train_preference.py configs/dpo_math.yaml",
        ".venv/bin/torchrun --nnodes 2 --nproc_per_node 8 \\",
        "srun --kill-on-bad-exit=1 .venv/bin/torchrun \\",
        "torchrun trainers/train_sft.py configs/sft_help.yaml",
        "python -m torch.distributed.run --standalone trainers/train_rl.py",
        "OMP_NUM_THREADS=1 torchrun $ARGS",
        '"""torchrun --standalone --nproc_per_node N trainers/train_rl.py CONFIG.yaml',
    ]
    assert bare_torchrun_launches("\n".join(bare)) == bare
    fine = [
        ".venv/bin/python -m veomni_lite.torchrun --standalone --nproc_per_node 2 trainers/train_rl.py x.yaml",
        "One torchrun agent per node; they meet over torchrun's c10d rendezvous",
        "under `torchrun` the same lines normalize; two torchrun launches of `trainers/train_sft.py`'s trainer",
        "no page launches plain torchrun (`tests/test_readme.py`).",
    ]
    assert bare_torchrun_launches("\n".join(fine)) == []
