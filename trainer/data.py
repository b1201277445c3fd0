"""Training data: endless, seeded (tokens, labels) microbatches of text. `batches` is the trainer's entry point.

Sources (`--data`):
- nothing: the Python standard library's own source, read at run time, so every machine with Python has it and nothing
  is downloaded or committed;
- a text file: memory-mapped whole; only the pages that sampled windows touch are read;
- a folder of text files: read into memory up to `max_bytes` (a warning says when that cuts it);
- a folder written by `datasets`' `save_to_disk`: memory-mapped Arrow, records read a block at a time, blocks in a
  seeded order;
- `hf:OWNER/NAME[/CONFIG]` or `hf:NAME`: a Hugging Face hub dataset, streamed through a seeded shuffle buffer.

Tokens are bytes (ids < 256, nothing to download) unless `--tokenizer` names a `tokenizers` JSON file. Byte-level text
corpora keep the original sampler, `microbatches`: random windows of the bytes. Everything else is tokenized as it is
read, cut into sequences of seq_len + 1 tokens, and drawn at random from a pool of SHUFFLE_WINDOWS sequences. No source
is ever read whole into memory, except a folder of text files (up to its cap).
"""

from __future__ import annotations

import itertools
import logging
import os
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]
BYTE_VOCAB = 256
FOLDER_MAX_BYTES = 32 << 20  # a folder of text files (or the standard library) is read into memory up to this
MIN_CORPUS_BYTES = 1024
CHUNK_BYTES = 1 << 20  # a tokenized text corpus is visited in line-aligned chunks of about this size, in seeded order
LINE_SEARCH_BYTES = 64 << 10  # a chunk ends at the first line start this far past its nominal end, else right there
RECORDS_PER_BLOCK = 256  # dataset records read and tokenized together
SHUFFLE_WINDOWS = 1024  # tokenized sequences pooled; each microbatch draws its sequences from the pool at random
HUB_SHUFFLE_BUFFER = 10_000  # records in a streamed hub dataset's shuffle buffer


# files that are not text, or text in a structure (JSON, tables) that byte-level training would learn as such: refused
# as a --data file, rather than read as bytes
DATASET_SUFFIXES = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
}  # -> `datasets` builder
ARCHIVE_SUFFIXES = (".gz", ".tgz", ".bz2", ".xz", ".zst", ".lz4", ".zip", ".tar", ".7z")
ACCEPTED = (
    "--data takes a text file, a folder of text files, a folder written by `datasets`' save_to_disk, or a hub "
    "dataset hf:OWNER/NAME"
)


def check_text_file(path: Path) -> None:
    """ValueError naming --data if the file `path` is, by its name, a dataset file or an archive rather than text; it
    says what --data takes, and how to convert the file."""
    suffix = path.suffix.lower()
    if builder := DATASET_SUFFIXES.get(suffix):
        folder = path.with_suffix("")
        raise ValueError(
            f"--data {path}: a {suffix} file would be trained on as raw bytes, not read as records. {ACCEPTED}. "
            f"Save it as a dataset folder: python -c \"import datasets; datasets.load_dataset('{builder}', "
            f"data_files='{path}', split='train').save_to_disk('{folder}')\", then give --data {folder} "
            "(--data-column: the field holding the text)"
        )
    if suffix in ARCHIVE_SUFFIXES:
        raise ValueError(
            f"--data {path}: a {suffix} archive would be trained on as compressed bytes. {ACCEPTED}: unpack it first"
        )


def _files_under(root: Path) -> Iterator[Path]:
    """The files under `root`, not descending into site-packages (installed packages, not the standard library):
    a trainer's start reads the standard library, and listing and stat-ing a site-packages of tens of thousands of
    files only to skip them took 0.9 s of the 1.2 s the read took."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "site-packages"]
        yield from (Path(folder, name) for name in files)


def _read_tree(root: Path, max_bytes: int, suffixes: tuple[str, ...] | None) -> tuple[bytes, bool]:
    """The text files under `root`, in path order, joined by newlines, cut at `max_bytes`; and whether it was cut."""
    chunks, total, paths = [], 0, sorted(_files_under(root))
    for i, path in enumerate(paths):
        if not path.is_file() or (suffixes and path.suffix not in suffixes):
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if b"\0" in data[:4096]:  # binary
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            joined = b"\n".join(chunks)
            return joined[:max_bytes], len(joined) > max_bytes or i + 1 < len(paths)
    return b"\n".join(chunks), False


def load_corpus(path: str | None = None, max_bytes: int = FOLDER_MAX_BYTES) -> torch.Tensor:
    """(N,) uint8 tensor of text bytes. `path`: a file, memory-mapped whole (`max_bytes` does not apply), or a folder of
    text files, read up to `max_bytes` with a warning when that cuts it. None: the standard library's source, up to
    `max_bytes` (a fixed sample: no warning)."""
    if path is None:
        data, _ = _read_tree(Path(sysconfig.get_paths()["stdlib"]), max_bytes, suffixes=(".py",))
    else:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"--data {path}: no such file or folder")
        if p.is_file():
            check_text_file(p)
            size = p.stat().st_size
            if size < MIN_CORPUS_BYTES:
                raise ValueError(f"--data {path} has only {size} bytes of text")
            # A private map: pages are read when a window touches them, and nothing is ever written back.
            return torch.from_file(str(p), shared=False, size=size, dtype=torch.uint8)
        data, cut = _read_tree(p, max_bytes, suffixes=None)
        if cut:
            logger.warning(
                "--data %s: the folder holds more text than the %d MiB kept in memory (load_corpus max_bytes); "
                "training sees only the first %d MiB. Concatenate it into one file to train on all of it.",
                path,
                max_bytes >> 20,
                max_bytes >> 20,
            )
    if len(data) < MIN_CORPUS_BYTES:
        raise ValueError(f"corpus at {path or 'the standard library'} has only {len(data)} bytes of text")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def microbatches(corpus: torch.Tensor, batch_size: int, seq_len: int, seed: int) -> Iterator[Batch]:
    """Endless (tokens, labels), each (batch_size, seq_len) int64, labels shifted by one byte. Seeded."""
    if len(corpus) <= seq_len + 1:
        raise ValueError(f"corpus ({len(corpus)} bytes) is shorter than a sequence ({seq_len + 1})")
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, len(corpus) - seq_len - 1, (batch_size, 1), generator=gen)
        window = corpus[starts + offsets].long()  # (B, T + 1)
        yield window[:, :-1].contiguous(), window[:, 1:].contiguous()


def load_tokenizer(path: str | None, vocab_size: int) -> Tokenizer | None:
    """The `tokenizers` tokenizer saved at `path`, or None for byte-level tokens; either way its ids fit the model's
    vocabulary of `vocab_size`."""
    if not path:
        if vocab_size < BYTE_VOCAB:
            raise ValueError(
                f"byte-level tokens need --vocab-size >= {BYTE_VOCAB}, got {vocab_size} (or a --tokenizer)"
            )
        return None
    from tokenizers import Tokenizer

    if not Path(path).is_file():
        raise FileNotFoundError(f"--tokenizer {path}: no such file")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ValueError(f"--tokenizer {path}: not a `tokenizers` JSON file ({e})") from e
    n_ids = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    if n_ids > vocab_size:
        raise ValueError(
            f"--tokenizer {path} has token ids up to {n_ids - 1}, beyond the model's --vocab-size {vocab_size}: "
            f"give --vocab-size {n_ids} or more, or a smaller tokenizer"
        )
    return tokenizer


def parse_hub_name(data: str) -> tuple[str, str | None]:
    """`hf:OWNER/NAME[/CONFIG]` or `hf:NAME` -> (the hub repository, its config or None)."""
    parts = data.removeprefix("hf:").split("/")
    if not all(parts) or len(parts) > 3:
        raise ValueError(f"--data {data}: a hub dataset is hf:OWNER/NAME, hf:OWNER/NAME/CONFIG or hf:NAME")
    return "/".join(parts[:2]), parts[2] if len(parts) == 3 else None


def check_paths(data: str | None, tokenizer: str | None) -> None:
    """ValueError naming the flag if `data` or `tokenizer` names a path that does not exist, or `data` a file that is
    not text (`check_text_file`): said before the trainer starts its DHT node, not once it opens them. A hub dataset
    is checked when it is streamed."""
    if data is not None and not data.startswith("hf:"):
        if not Path(data).exists():
            raise ValueError(f"--data {data}: no such file or folder")
        if Path(data).is_file():
            check_text_file(Path(data))
    if tokenizer and not Path(tokenizer).is_file():
        raise ValueError(f"--tokenizer {tokenizer}: no such file")


def is_saved_dataset(path: Path) -> bool:
    """Whether `path` is a folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "dataset_info.json").is_file() and (path / "state.json").is_file()
    )


def _encode(tokenizer: Tokenizer | None, texts: list[str], special_tokens: bool) -> np.ndarray:
    """(n,) int32: the token ids of `texts`, concatenated (UTF-8 bytes without a tokenizer)."""
    if tokenizer is None:
        return np.frombuffer("".join(texts).encode(), dtype=np.uint8).astype(np.int32)
    encodings = tokenizer.encode_batch(texts, add_special_tokens=special_tokens)
    return np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype=np.int32)


def _line_start(text: np.ndarray, offset: int) -> int:
    """The first line start at or after `offset`, or `offset` itself when no newline is within LINE_SEARCH_BYTES."""
    if offset <= 0 or offset >= len(text):
        return min(max(offset, 0), len(text))
    newlines = np.flatnonzero(text[offset - 1 : offset - 1 + LINE_SEARCH_BYTES] == ord("\n"))
    return offset + int(newlines[0]) if len(newlines) else offset


def _corpus_tokens(text: np.ndarray, tokenizer: Tokenizer | None, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Endless: the byte corpus `text` in line-aligned chunks of about CHUNK_BYTES (they partition it), each epoch in
    a new seeded order, each chunk tokenized line by line as it is visited."""
    while True:
        n_tokens = 0
        for k in rng.permutation(-(-len(text) // CHUNK_BYTES)):
            start, end = _line_start(text, int(k) * CHUNK_BYTES), _line_start(text, (int(k) + 1) * CHUNK_BYTES)
            lines = text[start:end].tobytes().decode(errors="replace").splitlines(keepends=True)
            ids = _encode(tokenizer, lines, special_tokens=False)
            n_tokens += len(ids)
            yield ids
        if n_tokens == 0:
            raise ValueError("the tokenizer made no tokens of the whole corpus")


def _record_tokens(
    epoch_blocks: Callable[[int], Iterable[list[str | None]]], tokenizer: Tokenizer | None, source: str
) -> Iterator[np.ndarray]:
    """Endless: epoch after epoch of blocks of records' texts, tokenized (with the tokenizer's document markers, if it
    has them) and separated by newlines, as the files of a folder are."""
    for epoch in itertools.count():
        n_tokens = 0
        for texts in epoch_blocks(epoch):
            ids = _encode(tokenizer, [t if t.endswith("\n") else t + "\n" for t in texts if t], special_tokens=True)
            n_tokens += len(ids)
            yield ids
        if n_tokens == 0:
            raise ValueError(f"--data {source}: no text in any record")


def _check_column(columns: Iterable[str], column: str, source: str) -> None:
    if column not in columns:
        raise ValueError(f"--data-column {column!r} is not a column of {source}; it has {sorted(columns)}")


def _disk_blocks(path: str, split: str, column: str, rng: np.random.Generator) -> Callable[[int], Iterator[list]]:
    """A `save_to_disk` folder's texts per epoch: blocks of RECORDS_PER_BLOCK consecutive records, blocks in a new
    seeded order each epoch. The Arrow files are memory-mapped: a block is read when it is reached."""
    from datasets import DatasetDict, load_from_disk

    dataset = load_from_disk(path)
    if isinstance(dataset, DatasetDict):
        if split not in dataset:
            raise ValueError(f"--data-split {split!r} is not a split of {path}; it has {sorted(dataset)}")
        dataset = dataset[split]
    _check_column(dataset.column_names, column, path)
    dtype = getattr(dataset.features[column], "dtype", None)
    if dtype not in ("string", "large_string"):
        raise ValueError(f"--data-column {column!r} of {path} holds {dataset.features[column]}, not text")
    dataset = dataset.select_columns([column])
    n_blocks = -(-len(dataset) // RECORDS_PER_BLOCK)

    def blocks(epoch: int) -> Iterator[list]:
        for b in rng.permutation(n_blocks):
            yield dataset[int(b) * RECORDS_PER_BLOCK : (int(b) + 1) * RECORDS_PER_BLOCK][column]

    return blocks


def _hub_blocks(data: str, split: str, column: str, seed: int) -> Callable[[int], Iterator[list]]:
    """A hub dataset's texts per epoch, streamed through a shuffle buffer of HUB_SHUFFLE_BUFFER records."""
    from datasets import load_dataset

    name, config = parse_hub_name(data)
    dataset = load_dataset(name, config, split=split, streaming=True)
    if dataset.column_names is not None:  # else known only once records arrive
        _check_column(dataset.column_names, column, data)
    dataset = dataset.shuffle(seed=seed, buffer_size=HUB_SHUFFLE_BUFFER)

    def blocks(epoch: int) -> Iterator[list]:
        dataset.set_epoch(epoch)
        records = iter(dataset)
        while block := list(itertools.islice(records, RECORDS_PER_BLOCK)):
            _check_column(block[0], column, data)
            yield [record[column] for record in block]

    return blocks


def _windows(chunks: Iterator[np.ndarray], width: int) -> Iterator[np.ndarray]:
    """The concatenated token stream cut into consecutive, non-overlapping (width,) windows."""
    rest = np.empty(0, dtype=np.int32)
    for ids in chunks:
        rest = np.concatenate([rest, ids])
        n = len(rest) // width
        yield from rest[: n * width].reshape(n, width)
        rest = rest[n * width :]


def _pooled(chunks: Iterator[np.ndarray], batch_size: int, seq_len: int, rng: np.random.Generator) -> Iterator[Batch]:
    """Microbatches of sequences drawn at random from a pool of SHUFFLE_WINDOWS (at least batch_size) windows of the
    token stream; the drawn slots are refilled from the stream before the next draw."""
    capacity = max(SHUFFLE_WINDOWS, batch_size)
    pool = np.empty((capacity, seq_len + 1), dtype=np.int32)  # (P, T + 1)
    free = list(range(capacity))
    for window in _windows(chunks, seq_len + 1):
        pool[free.pop()] = window
        if not free:
            picks = rng.choice(capacity, batch_size, replace=False)
            batch = torch.from_numpy(pool[picks]).long()  # (B, T + 1), a copy
            free = picks.tolist()
            yield batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


def batches(
    data: str | None,
    *,
    batch_size: int,
    seq_len: int,
    seed: int,
    vocab_size: int,
    tokenizer: str | None = None,
    column: str = "text",
    split: str = "train",
) -> Iterator[Batch]:
    """Endless (tokens, labels) from `data` (`--data`, see the module docstring), each (batch_size, seq_len) int64,
    labels the tokens shifted by one; ids < `vocab_size`; the same sequence for the same `seed`. Opens the source and
    checks the flags now, with errors that name them; reads lazily as microbatches are drawn. Byte-level text corpora
    give exactly `microbatches(load_corpus(data), batch_size, seq_len, seed)`."""
    tok = load_tokenizer(tokenizer, vocab_size)
    order_rng, pool_rng = np.random.default_rng(seed).spawn(2)
    tokens = f"tokenizer {tokenizer}" if tok else "byte tokens"
    if data is not None and data.startswith("hf:"):
        chunks = _record_tokens(_hub_blocks(data, split, column, seed), tok, data)
        logger.info("data: hub dataset %s, split %s, column %s, %s", data[3:], split, column, tokens)
    elif data is not None and is_saved_dataset(Path(data)):
        chunks = _record_tokens(_disk_blocks(data, split, column, order_rng), tok, data)
        logger.info("data: dataset %s, split %s, column %s, %s", data, split, column, tokens)
    else:
        corpus = load_corpus(data)
        logger.info("data: %.1f MB from %s, %s", len(corpus) / 1e6, data or "the Python standard library", tokens)
        if tok is None:
            return microbatches(corpus, batch_size, seq_len, seed)
        chunks = _corpus_tokens(corpus.numpy(), tok, order_rng)
    return _pooled(chunks, batch_size, seq_len, pool_rng)
