"""The figures the README and docs quote are those of a recorded run (docs/figures.json, written by `make figures`)
at a commit in HEAD's history: each `<!-- figure:NAME -->` block is what its run renders, numbers included. Nothing
runs here; the negative controls edit a copy of the pages."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("figures", REPO / "scripts" / "figures.py")
figures = importlib.util.module_from_spec(_spec)
sys.modules["figures"] = figures  # its dataclass looks its module up there
_spec.loader.exec_module(figures)


def in_git_history() -> bool:
    """A full clone: a shallow one may lack the figures' commits (the ancestry check then skips)."""
    done = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True, text=True)
    return done.returncode == 0 and done.stdout.strip() == "false"


@pytest.fixture(scope="module")
def recorded() -> tuple[dict[str, str], dict[str, dict]]:
    if not in_git_history():
        pytest.skip("not a full git clone: the figures' commits cannot be checked")
    return figures.pages(REPO), json.loads((REPO / figures.RESULTS).read_text())


def test_every_figure_on_the_pages_is_its_recorded_run_at_an_ancestor_of_head(recorded):
    texts, results = recorded
    assert figures.problems(texts, results, REPO) == []
    quoted = {match.group(1) for text in texts.values() for match in figures.BLOCK.finditer(text)}
    assert quoted == set(results) == set(figures.FIGURES), "every figure recorded and quoted"


def test_an_edited_number_is_a_drift(recorded):
    """The negative control: one quoted number changed on a copy of the README."""
    texts, results = recorded
    readme = texts["README.md"]
    block = next(m for m in figures.BLOCK.finditer(readme) if m.group(1) == "train")
    number = re.search(r"0\.\d{3}", block.group(3)).group(0)
    edited = block.group(0).replace(number, f"{min(float(number) + 0.001, 0.999):.3f}", 1)
    assert edited != block.group(0)
    found = figures.problems({**texts, "README.md": readme.replace(block.group(0), edited)}, results, REPO)
    assert found == ["README.md: figure:train differs from its run in docs/figures.json"]


def test_a_commit_outside_heads_history_is_a_drift(recorded):
    """The negative control: the recorded commit replaced by one HEAD does not descend from (here: not a commit)."""
    texts, results = recorded
    moved = {**results, "train": {**results["train"], "commit": "0" * 40}}
    found = figures.problems(texts, moved, REPO)
    assert "docs/figures.json: train's commit 000000000000 is not an ancestor of HEAD" in found


def test_a_new_minor_version_is_a_drift(recorded):
    """The negative control: the checkout's version moved on from the figures' commits (0.1 there)."""
    texts, results = recorded
    found = figures.problems(texts, results, REPO, version="0.2")
    assert len(found) == len(results) and all("ran at version 0.1, the checkout is 0.2" in line for line in found)


def test_a_block_of_no_recorded_run_is_a_drift(recorded):
    texts, results = recorded
    stray = texts["README.md"] + "\n<!-- figure:nowhere -->\nOne run: 0.999\n<!-- /figure -->\n"
    found = figures.problems({**texts, "README.md": stray}, results, REPO)
    assert found == [f"README.md: figure:nowhere is no recorded figure (docs/figures.json has {sorted(results)})"]


def test_render_states_the_command_commit_and_what_the_time_leaves_out():
    result = {"commit": "a" * 40, "date": "2026-12-03", "machine": "2 CPU cores", "seconds": 85.2}
    result |= {"load_1min": [1, 2.5], "values": {"200": 0.5, "100": 0.25}, "log": ["step 2/2 | x"], "before": 0.0}
    text = figures.render("train-lora", result)
    flat = " ".join(text.split())
    assert "`make train-lora`" in flat and "at aaaaaaa, 2026-12-03, on 2 CPU cores" in flat
    assert "0.000 before the run, then 0.250 and 0.500 at steps 100 and 200, in 1 min 25 s" in flat
    assert "(1-minute load 1.0 before, 2.5 after), not counting `make install`" in flat
    assert all(len(line) <= 120 for line in text.splitlines())
    assert figures.render("train", result, log=True) == "```\nstep 2/2 | x\n```\n"


def test_a_run_names_its_cpu_and_torchs_kernels():
    """A demo's figures reproduce on the same kind of CPU: torch's float32 kernels (AVX512, AVX2, ...) round
    differently, so a run records which it used."""
    import torch

    cores, rest = figures.machine().split(" CPU cores (")
    assert int(cores) == os.cpu_count()
    assert rest.endswith(f", torch's {torch.backends.cpu.get_cpu_capability()} kernels)")


def test_render_quotes_the_json_file_a_job_writes():
    result = {"commit": "b" * 40, "date": "2026-12-03", "machine": "2 CPU cores", "seconds": 40.0}
    result |= {"load_1min": [1, 1], "values": {"1": 0.0, "200": 0.92}, "log": []}
    result["quoted"] = {"warm start": 0.325, "after DPO": 0.68}
    flat = " ".join(figures.render("train-dpo", result).split())
    assert "0.000 and 0.920 at steps 1 and 200; `greedy_accuracy.json`: warm start 0.325, after DPO 0.680," in flat
