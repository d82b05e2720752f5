"""`veomni_lite.export` round trips: a two-step run of each transformers trainer, exported, loaded with the stock
transformers classes, gives the trained model's own logits on a real batch (Qwen2-VL through its own forward, so our
collator's M-RoPE positions and index-placed image features are checked against transformers' get_rope_index and
masked_scatter); the image head file reproduces `image_logits`; nothing exported is a pickle."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from examples.qwen2_pydoc_text import PydocLMTrainer
from tests.models.small_hf import REPO, small_config, train_small
from tests.trainer.helpers import run_trainer, tiny_config
from veomni_lite import export as export_module
from veomni_lite.export import export
from veomni_lite.loss_keys import is_labels_key
from veomni_lite.models.qwen2_vl import IMAGE_HEAD_FILE

TOLERANCE = 1e-6
PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"}


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("text_export")
    trainer = train_small("text", root / "run")
    trainer.model.cpu()  # compared with the exports on the CPU, whatever device trained
    step, files = export(root / "run", root / "export")
    return trainer, root, step, files


@pytest.fixture(scope="module")
def vl_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_export")
    trainer = train_small("vl", root / "run")
    trainer.model.cpu()  # compared with the exports on the CPU, whatever device trained
    step, files = export(root / "run", root / "export")
    return trainer, root, step, files


def assert_no_pickle(export_dir: Path) -> None:
    for path in export_dir.rglob("*"):
        assert path.suffix not in PICKLE_SUFFIXES, path
        if path.is_file():
            assert path.read_bytes()[:1] != b"\x80", f"{path} starts like a pickle"


def test_text_export_files_and_step(text_run):
    trainer, root, step, files = text_run
    assert step == trainer.step == 2
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    assert files == sorted(p.name for p in (root / "export").iterdir())
    assert_no_pickle(root / "export")


def test_text_export_loads_with_auto_classes_and_gives_the_trained_logits(text_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer, root, _, _ = text_run
    data = trainer.eval_dataset
    batch = trainer.collate([data[i] for i in range(4)])
    model = trainer.model.eval()
    exported = AutoModelForCausalLM.from_pretrained(root / "export").eval()
    reloaded = export_module.build_model(root / "run" / "model_config")
    export_module.CheckpointManager(root / "run" / "checkpoints").load_model_weights(reloaded)
    with torch.no_grad():
        ours = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])["logits"]
        theirs = exported(input_ids=batch["input_ids"]).logits
        from_checkpoint = reloaded.eval()(input_ids=batch["input_ids"], position_ids=batch["position_ids"])["logits"]
    assert ours.shape == (4, 32, data.vocab_size)
    assert max_diff(theirs, ours) <= TOLERANCE
    assert max_diff(from_checkpoint, ours) == 0.0

    tokenizer = AutoTokenizer.from_pretrained(root / "export")
    text = "The for statement iterates over the elements of a sequence."
    assert tokenizer(text)["input_ids"] == trainer.tokenizer.encode(text).ids
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        data.pad_id,
        data.bos_id,
        data.eos_id,
    )
    assert tokenizer.decode(batch["input_ids"][0, 1:].tolist()) == data.decode(batch["input_ids"][0, 1:].tolist())


def test_vl_export_files_and_step(vl_run):
    trainer, root, step, files = vl_run
    assert step == trainer.step == 2
    expected = {"config.json", "model.safetensors", IMAGE_HEAD_FILE, "tokenizer.json", "tokenizer_config.json"}
    assert expected <= set(files)
    assert_no_pickle(root / "export")


def test_vl_export_stock_forward_gives_the_trained_logits(vl_run):
    """Stock `Qwen2VLForConditionalGeneration` forward (its own get_rope_index from mm_token_type_ids, features
    placed by masked_scatter) on a padded batch of understanding and generation samples vs our wrapper (our
    collator's positions, features placed by index)."""
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    trainer, root, _, _ = vl_run
    data = trainer.eval_dataset
    samples = [data[0], data[1], data[2], data[5]]  # understanding, generation, understanding, generation
    batch = trainer.collate(samples)
    lengths = torch.tensor([s["input_ids"].numel() for s in samples])
    valid = torch.arange(batch["input_ids"].shape[1]) < lengths[:, None]
    image_tokens = (batch["input_ids"] == data.image_token_id).long()
    assert batch["image_grid_thw"].shape == (2, 3)

    model = trainer.model.eval()
    exported = Qwen2VLForConditionalGeneration.from_pretrained(root / "export").eval()
    assert exported.config.image_token_id == data.image_token_id
    with torch.no_grad():
        ours = model(**{key: value for key, value in batch.items() if not is_labels_key(key)})
        stock = dict(
            input_ids=batch["input_ids"],
            attention_mask=valid.long(),
            pixel_values=batch["pixel_values"],
            image_grid_thw=batch["image_grid_thw"],
            mm_token_type_ids=image_tokens,
        )
        theirs = exported(**stock).logits
        hidden = exported.model(**stock).last_hidden_state
        positions, _ = exported.model.get_rope_index(
            batch["input_ids"], image_tokens, batch["image_grid_thw"], attention_mask=valid.long()
        )
    assert torch.equal(positions.permute(1, 2, 0)[valid], batch["position_ids"][valid])
    assert max_diff(theirs[valid], ours["logits"][valid]) <= TOLERANCE

    from safetensors.torch import load_file

    head_state = load_file(str(root / "export" / IMAGE_HEAD_FILE))
    width = exported.config.text_config.hidden_size
    head = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, exported.config.image_decoder_classes))
    head.load_state_dict(head_state)
    with torch.no_grad():
        image_logits = head(hidden)
    assert image_logits.shape[-1] == 17
    assert max_diff(image_logits[valid], ours["image_logits"][valid]) <= TOLERANCE

    tokenizer = AutoTokenizer.from_pretrained(root / "export")
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == data.image_token_id
    assert tokenizer.pad_token_id == data.pad_id
    understanding = samples[0]["input_ids"].tolist()
    assert tokenizer(tokenizer.decode(understanding, skip_special_tokens=False))["input_ids"] == understanding


def test_export_of_a_tiny_model_run_is_a_clear_error(tmp_path, capsys):
    out = tmp_path / "tiny"
    run_trainer("text", tiny_config("text", out, max_steps=1))
    with pytest.raises(FileNotFoundError, match="export needs a run of a transformers model"):
        export(out, tmp_path / "export")
    assert not (tmp_path / "export").exists()
    assert export_module.main([str(out), str(tmp_path / "export")]) == 2
    assert "export error:" in capsys.readouterr().err


@pytest.mark.slow
def test_export_cli(text_run, tmp_path):
    _, root, _, files = text_run
    result = subprocess.run(
        [sys.executable, "-m", "veomni_lite.export", str(root / "run"), str(tmp_path / "cli")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"exported step 2 of {root / 'run'} to {tmp_path / 'cli'}: {', '.join(files)}" in result.stdout
    assert sorted(p.name for p in (tmp_path / "cli").iterdir()) == files


def test_a_run_from_the_export_as_pretrained_dir_starts_at_the_trained_weights(text_run):
    trainer, root, _, _ = text_run
    again = PydocLMTrainer(small_config("text", root / "again", "--model.pretrained_dir", str(root / "export")))
    try:
        batch = trainer.collate([trainer.eval_dataset[i] for i in range(2)])
        inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
        with torch.no_grad():
            started = again.model.cpu().eval()(**inputs)["logits"]
            assert max_diff(started, trainer.model.eval()(**inputs)["logits"]) == 0.0
        assert again.tokenizer.get_vocab() == trainer.tokenizer.get_vocab()
    finally:
        again.close()


def test_a_pretrained_dir_whose_tokenizer_outgrows_the_embedding_is_a_clear_error(text_run, tmp_path):
    import shutil

    from transformers import PreTrainedTokenizerFast

    _, root, _, _ = text_run
    directory = tmp_path / "grown"
    shutil.copytree(root / "export", directory)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory))
    tokenizer.add_tokens(["<new_token>"])  # one more id than the model embeds
    tokenizer.save_pretrained(str(directory))
    config = small_config("text", root / "grown_run", "--model.pretrained_dir", str(directory))
    with pytest.raises(ValueError, match=r"has a tokenizer of 301 tokens but the model embeds only 300"):
        PydocLMTrainer(config)


def test_tokenizer_files_are_copied_byte_for_byte_and_a_chat_template_override_wins(tmp_path):
    """`copy_tokenizer_files`: what the directory has, byte for byte; an override as chat_template.jinja without the
    processor's legacy chat_template.json (which a processor reads first); stale files pruned where asked."""
    from tests.data.test_chat_families import write_family
    from veomni_lite.export import copy_tokenizer_files
    from veomni_lite.models.pretrained import load_tokenizer

    source = write_family(tmp_path / "source", "llama3")
    settings = json.loads((source / "tokenizer_config.json").read_text())  # a release's template inline, as older do
    (source / "tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": "{{ 'inline' }}"}))
    (source / "chat_template.json").write_text('{"chat_template": "legacy"}')
    (source / "additional_chat_templates").mkdir()
    (source / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    copied = copy_tokenizer_files(source, tmp_path / "plain")
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"} <= set(copied)
    for name in copied:
        path = source / name
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
        for file in files:
            assert (tmp_path / "plain" / file.relative_to(source)).read_bytes() == file.read_bytes(), file

    target = tmp_path / "overridden"
    target.mkdir()
    (target / "special_tokens_map.json").write_text("{}")  # an earlier run's, which the source does not have
    copy_tokenizer_files(source, target, "{{ 'override' }}", prune=True)
    assert not (target / "chat_template.json").exists() and not (target / "special_tokens_map.json").exists()
    assert (target / "chat_template.jinja").read_text() == "{{ 'override' }}"
    assert (target / "tokenizer_config.json").read_bytes() == (source / "tokenizer_config.json").read_bytes()
    tokenizer = load_tokenizer(target)
    assert tokenizer.chat_template["default"] == "{{ 'override' }}", "chat_template.jinja before tokenizer_config"
    assert tokenizer.chat_template["tool_use"] == "{{ messages }}"
