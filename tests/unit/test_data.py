"""Training data from every kind of `--data`: files memory-mapped whole, `save_to_disk` datasets read lazily, text
tokenized by a `tokenizers` file; labels are the tokens shifted by one, ids fit the vocabulary, seeds repeat. The
datasets and the tokenizer are made here; nothing is downloaded."""

import itertools
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.config import TrainerConfig
from trainer.data import FOLDER_MAX_BYTES, batches, load_corpus, microbatches, parse_hub_name

pytestmark = pytest.mark.timeout(60)

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()
VOCAB = 300


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 30)))) + "." for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> str:
    """A byte-level BPE of VOCAB tokens trained on the test sentences, saved as `tokenizers` JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sentences(500), trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> str:
    """A `DatasetDict.save_to_disk` folder: splits train and test, columns text and n."""
    from datasets import Dataset, DatasetDict

    texts = sentences(600, seed=1)
    path = tmp_path_factory.mktemp("ds") / "saved"
    DatasetDict(
        train=Dataset.from_dict({"text": texts, "n": list(range(len(texts)))}),
        test=Dataset.from_dict({"text": texts[:50], "n": list(range(50))}),
    ).save_to_disk(str(path))
    return str(path)


def assert_shifted(tokens: torch.Tensor, labels: torch.Tensor, batch_size: int, seq_len: int) -> None:
    assert tokens.shape == labels.shape == (batch_size, seq_len)
    assert tokens.dtype == labels.dtype == torch.int64
    assert torch.equal(tokens[:, 1:], labels[:, :-1])


def test_a_file_is_memory_mapped_whole_not_cut_at_the_folder_cap(tmp_path):
    """A sparse file four times the folder cap, text only in its last eighth: windows come from there, and sampling
    does not load the file."""
    path, size = tmp_path / "big.txt", 4 * FOLDER_MAX_BYTES
    line = b"beyond the cap\n"
    with open(path, "wb") as f:
        f.truncate(size)
        f.seek(size - size // 8)
        f.write(line * (size // 8 // len(line)))

    def anonymous_memory() -> int:  # what a read into memory would grow; a map's touched pages count as RssFile
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(line for line in status if line.startswith("RssAnon:")).split()[1]) << 10

    before = anonymous_memory()
    corpus = load_corpus(str(path))
    assert len(corpus) == size
    tokens, labels = next(microbatches(corpus, 64, 32, seed=0))
    assert_shifted(tokens, labels, 64, 32)
    assert (tokens == ord("y")).any(dim=1).sum() >= 2  # P(< 2 of 64 windows in the last eighth) < 1e-3; seeded
    assert anonymous_memory() - before < FOLDER_MAX_BYTES // 4  # a copy of the file would add 4x the cap


def test_a_file_through_batches_is_the_byte_sampler(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("\n".join(sentences(200)))
    got = batches(str(path), batch_size=4, seq_len=16, seed=3, vocab_size=256)
    want = microbatches(torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8), 4, 16, seed=3)
    for (t1, l1), (t2, l2) in itertools.islice(zip(got, want, strict=True), 5):
        assert torch.equal(t1, t2) and torch.equal(l1, l2)
        assert_shifted(t1, l1, 4, 16)


def test_a_folder_cut_at_the_cap_says_so(tmp_path, caplog):
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text("x" * 1000)
    with caplog.at_level(logging.WARNING, logger="trainer.data"):
        assert len(load_corpus(str(tmp_path), max_bytes=2500)) == 2500
    assert "more text than" in caplog.text
    caplog.clear()
    assert len(load_corpus(str(tmp_path), max_bytes=10_000)) == 3002  # three files, two newlines
    assert not caplog.records


def test_saved_dataset_with_tokenizer(dataset_dir, tokenizer_file):
    stream = batches(dataset_dir, batch_size=8, seq_len=24, seed=0, vocab_size=VOCAB, tokenizer=tokenizer_file)
    for tokens, labels in itertools.islice(stream, 20):
        assert_shifted(tokens, labels, 8, 24)
        assert 0 <= int(tokens.min()) and int(labels.max()) < VOCAB
    assert int(tokens.max()) >= 256  # merged tokens, not bytes


@pytest.mark.parametrize("saved", ["DatasetDict", "Dataset"])
def test_saved_dataset_byte_level_decodes_to_its_text(tmp_path, dataset_dir, saved):
    if saved == "Dataset":
        from datasets import Dataset

        Dataset.from_dict({"text": sentences(50, seed=1)}).save_to_disk(str(tmp_path / "one"))
        data = str(tmp_path / "one")
    else:
        data = dataset_dir
    tokens, labels = next(batches(data, batch_size=4, seq_len=64, seed=0, vocab_size=256, split="test"))
    assert_shifted(tokens, labels, 4, 64)
    words = set(bytes(tokens[0].tolist()).decode().replace(".", " ").split())
    assert len(words) >= 3 and words <= set(WORDS)  # the first and last word may be cut by the window


def test_a_file_with_tokenizer_is_tokenized(tmp_path, tokenizer_file):
    path = tmp_path / "a.txt"
    path.write_text("\n".join(sentences(300, seed=2)))
    stream = batches(str(path), batch_size=4, seq_len=16, seed=0, vocab_size=VOCAB, tokenizer=tokenizer_file)
    tokens, labels = next(stream)
    assert_shifted(tokens, labels, 4, 16)
    assert int(labels.max()) < VOCAB and int(tokens.max()) >= 256


@pytest.mark.parametrize("data", ["file", "dataset"])
def test_the_seed_fixes_the_order(tmp_path, dataset_dir, tokenizer_file, data):
    if data == "file":
        path = tmp_path / "a.txt"
        path.write_text("\n".join(sentences(300, seed=2)))
        data = str(path)
    else:
        data = dataset_dir

    def first(seed: int) -> list[torch.Tensor]:
        stream = batches(data, batch_size=4, seq_len=16, seed=seed, vocab_size=VOCAB, tokenizer=tokenizer_file)
        return [tokens for tokens, _ in itertools.islice(stream, 5)]

    assert all(torch.equal(a, b) for a, b in zip(first(1), first(1), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first(1), first(2), strict=True))


def test_a_missing_column_lists_the_columns(dataset_dir):
    with pytest.raises(ValueError, match=r"--data-column 'body'.*\['n', 'text'\]"):
        batches(dataset_dir, batch_size=2, seq_len=8, seed=0, vocab_size=256, column="body")
    with pytest.raises(ValueError, match=r"--data-column 'n'.*not text"):
        batches(dataset_dir, batch_size=2, seq_len=8, seed=0, vocab_size=256, column="n")
    with pytest.raises(ValueError, match=r"--data-split 'validation'.*\['test', 'train'\]"):
        batches(dataset_dir, batch_size=2, seq_len=8, seed=0, vocab_size=256, split="validation")


def test_a_tokenizer_larger_than_the_vocabulary_names_both_flags(dataset_dir, tokenizer_file):
    with pytest.raises(ValueError, match=r"--tokenizer .*--vocab-size 256"):
        batches(dataset_dir, batch_size=2, seq_len=8, seed=0, vocab_size=256, tokenizer=tokenizer_file)
    with pytest.raises(ValueError, match=r"--vocab-size >= 256"):
        batches(None, batch_size=2, seq_len=8, seed=0, vocab_size=100)


def test_hub_names():
    assert parse_hub_name("hf:allenai/c4/en") == ("allenai/c4", "en")
    assert parse_hub_name("hf:Salesforce/wikitext") == ("Salesforce/wikitext", None)
    assert parse_hub_name("hf:imdb") == ("imdb", None)
    for bad in ("hf:", "hf:a//b", "hf:a/b/c/d"):
        with pytest.raises(ValueError, match="hf:OWNER/NAME"):
            parse_hub_name(bad)
    with pytest.raises(ValueError, match="hf:OWNER/NAME"):
        TrainerConfig(data="hf:a/b/c/d")


def test_hub_datasets_are_streamed(monkeypatch, tokenizer_file):
    """The hub path, offline: `load_dataset` answers with a local iterable (streaming) dataset."""
    import datasets

    calls = []

    def load_dataset(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        return datasets.Dataset.from_dict({"text": sentences(300, seed=3)}).to_iterable_dataset(num_shards=4)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    stream = batches("hf:owner/name/cfg", batch_size=4, seq_len=16, seed=0, vocab_size=VOCAB, tokenizer=tokenizer_file)
    for tokens, labels in itertools.islice(stream, 10):
        assert_shifted(tokens, labels, 4, 16)
        assert int(labels.max()) < VOCAB
    assert calls == [("owner/name", "cfg", "train", True)]
    with pytest.raises(ValueError, match=r"--data-column 'body'.*\['text'\]"):
        batches("hf:owner/name", batch_size=2, seq_len=8, seed=0, vocab_size=256, column="body")


def test_a_dataset_file_is_refused_with_how_to_convert_it_and_the_way_it_says_works(tmp_path, monkeypatch):
    """A .jsonl was trained on as raw bytes, JSON syntax and all. Now it is refused; the message's conversion, run as
    given, makes a folder that `batches` reads as records of its "text" field."""
    import json
    import re

    import datasets

    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": s, "id": i}) + "\n" for i, s in enumerate(sentences(300))))
    with pytest.raises(ValueError, match=r"a \.jsonl file would be trained on as raw bytes") as refused:
        batches(str(path), batch_size=2, seq_len=16, seed=0, vocab_size=256)
    assert "--data takes a text file, a folder of text files" in str(refused.value)
    code, folder = re.search(r'python -c "(.+)", then give --data (\S+)', str(refused.value)).groups()
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    exec(code)
    tokens, _ = next(batches(folder, batch_size=2, seq_len=16, seed=0, vocab_size=256))
    assert not (tokens == ord("{")).any()  # the text field, not the JSON
    for name in ("data.parquet", "data.arrow", "data.json", "corpus.txt.gz", "corpus.zip"):
        (tmp_path / name).write_bytes(b"x" * 2048)
        with pytest.raises(ValueError, match=f"--data {tmp_path / name}: a "):
            load_corpus(str(tmp_path / name))
