"""The Python-help-pages example: the BPE tokenizer (deterministic, read back from the run), the fixed-length split,
and decoding back to the corpus."""

from __future__ import annotations

import pytest
import torch

from examples import pydoc_text
from examples.pydoc_text import (
    PydocTextDataset,
    corpus_documents,
    load_or_train_tokenizer,
    train_tokenizer,
)
from tests.models.small_hf import REPO
from veomni_lite.loss_keys import IGNORE_INDEX

VOCAB, SEQ_LEN = 300, 32


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def splits(tokenizer):
    return PydocTextDataset(tokenizer, SEQ_LEN, "train"), PydocTextDataset(tokenizer, SEQ_LEN, "eval")


def test_tokenizer_is_deterministic_with_fixed_special_ids(tokenizer):
    assert train_tokenizer(VOCAB).to_str() == tokenizer.to_str()
    assert tokenizer.get_vocab_size() == VOCAB
    assert [tokenizer.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>")] == [0, 1, 2]


def test_tokenizer_is_read_back_from_the_run(tmp_path, monkeypatch, tokenizer):
    path = tmp_path / "run" / "tokenizer.json"
    assert load_or_train_tokenizer(path, VOCAB, save=False).to_str() == tokenizer.to_str()
    assert not path.exists()
    load_or_train_tokenizer(path, VOCAB)
    saved = path.read_text()

    def no_training(_vocab_size):
        raise AssertionError("trained again although the run has a tokenizer")

    monkeypatch.setattr(pydoc_text, "train_tokenizer", no_training)
    again = load_or_train_tokenizer(path, VOCAB)
    assert again.get_vocab() == tokenizer.get_vocab()
    text = "Return the value of the named attribute of object."
    assert again.encode(text).ids == tokenizer.encode(text).ids
    assert path.read_text() == saved
    with pytest.raises(ValueError, match=r"has a vocabulary of 300 tokens, the config asks for 512"):
        load_or_train_tokenizer(path, 512)


def test_split_sizes_and_sample_layout(tokenizer, splits):
    train, held_out = splits
    docs = corpus_documents()
    stream = [i for doc in docs for i in [*tokenizer.encode(doc).ids, 2]]
    chunks = len(stream) // (SEQ_LEN - 1)
    assert len(held_out) == int(chunks * 0.05) and len(train) == chunks - len(held_out)
    assert len(train) > 1000 and len(held_out) > 50
    body = torch.cat([train.chunks.flatten(), held_out.chunks.flatten()])
    assert body.tolist() == stream[: chunks * (SEQ_LEN - 1)], "train is the head of the stream, eval its tail"
    assert all(torch.equal(train[i]["input_ids"][1:], train.chunks[i]) for i in (0, 1, len(train) - 1))
    for data in splits:
        sample = data[len(data) - 1]
        assert sample["input_ids"].shape == (SEQ_LEN,) and sample["input_ids"][0].item() == data.bos_id
        assert sample["labels"][0].item() == IGNORE_INDEX
        assert torch.equal(sample["labels"][1:], sample["input_ids"][1:]), "unshifted: the collator shifts"
    assert len(PydocTextDataset(tokenizer, SEQ_LEN, "eval", eval_fraction=0.0)) == 1
    with pytest.raises(ValueError, match="split must be 'train' or 'eval'"):
        PydocTextDataset(tokenizer, SEQ_LEN, "test")
    with pytest.raises(ValueError, match="seq_len must be >= 2"):
        PydocTextDataset(tokenizer, 1, "train")


def test_decoding_gives_back_the_corpus(tokenizer, splits):
    docs = corpus_documents()
    for doc in docs[:20]:
        assert tokenizer.decode(tokenizer.encode(doc).ids) == doc
    train, _ = splits
    ids = train.chunks.flatten().tolist()
    ends = [index for index, token in enumerate(ids) if token == train.eos_id]
    assert len(ends) >= 3
    assert train.decode(ids[: ends[2] + 1]) == "".join(docs[:3]), "documents in sorted order, <eos> between them"


@pytest.mark.slow
def test_tokenizers_are_identical_in_other_processes(tokenizer):
    """Every rank of a fresh run trains its own tokenizer (only rank 0 saves it): ids must not depend on the process
    or its thread count (hash seeds, parallel BPE counting)."""
    import hashlib
    import os
    import subprocess
    import sys

    from examples.digits import train_tokenizer as train_digits_tokenizer

    script = (
        "import hashlib\n"
        "from examples.pydoc_text import train_tokenizer\n"
        "from examples.digits import train_tokenizer as digits\n"
        f"print(hashlib.sha256(train_tokenizer({VOCAB}).to_str().encode()).hexdigest(),"
        " hashlib.sha256(digits().to_str().encode()).hexdigest())\n"
    )
    expected = " ".join(hashlib.sha256(t.to_str().encode()).hexdigest() for t in (tokenizer, train_digits_tokenizer()))
    for threads in ("1", "3"):
        env = dict(os.environ, RAYON_NUM_THREADS=threads, PYTHONHASHSEED=threads)
        result = subprocess.run(
            [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, env=env, timeout=120
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip() == expected
