"""Text corpora for language modelling: checks, tokenizer training with a cache, token streams.

Pure data code (no Lightning): the DataModule in :mod:`lightning_commstrats.data.datamodule` wires it.

- :func:`check_text_file` reads a file once before anything is trained on it and names the path
  (missing or empty file) or the path and line (bytes that are not UTF-8).
- :func:`load_tokenizer` trains a word-level vocabulary (the most frequent words, ``<unk>`` for the
  rest, as the 2018 multi-GPU NLM paper did) or a BPE model on the train split, and caches it under
  a key that changes with the corpus bytes and every setting; the cache file appears whole or not
  at all, one process trains while the others wait on a file lock, and the ids are checked dense
  in ``[0, vocab_size)`` whether trained or loaded (corpora that already contain ``<unk>``, as the
  standard word-level LM corpora do, get the special token's id for it).
- :class:`StreamWindows` and :class:`NGramWindows` turn a token stream into training examples;
  :class:`SentencePieces`, :class:`PadCollate` and :func:`bucket_batches` serve one sentence per
  example, padded per batch (optionally bucketed by length), with the result of the sentences
  taken one by one.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import tokenizers
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from torch import Tensor
from torch.utils.data import Dataset

log = logging.getLogger(__name__)

BROWN_DIR = Path(__file__).parent / "brown"
UNK, EOS, PAD = "<unk>", "<eos>", "<pad>"
SPECIAL_TOKENS = (UNK, EOS, PAD)
IGNORE_INDEX = -100
TOKENIZER_KINDS = ("word", "bpe")


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def check_text_file(path: str | os.PathLike) -> int:
    """Check that ``path`` exists, is UTF-8 throughout and has text; return its number of non-blank lines."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    lines = 0
    with _open_binary(path) as f:
        for number, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{path}, line {number}: bytes that are not UTF-8 ({err.reason} at byte {err.start} of the line)"
                ) from None
            lines += bool(text.strip())
    if lines == 0:
        raise ValueError(f"{path} is empty: it has no line of text")
    return lines


def file_digest(paths: Iterable[str | os.PathLike]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def default_cache_dir() -> Path:
    """Where tokenizers are cached unless told otherwise: ``$XDG_CACHE_HOME/lightning_commstrats/tokenizers``
    (``~/.cache/lightning_commstrats/tokenizers``), outside the installed package and shared by every corpus
    (the file names carry a key of the corpus bytes and the settings)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "lightning_commstrats" / "tokenizers"


def _without_special_tokens(lines: Iterable[str]) -> Iterator[str]:
    """The training text with the special tokens removed: a corpus that writes ``<unk>`` itself must
    not make the trainer count it as a word beside the special ``<unk>`` (that gave the vocabulary a
    hole at one id and an id equal to its size)."""
    special = set(SPECIAL_TOKENS)
    for line in lines:
        words = line.split()
        yield " ".join(w for w in words if w not in special) if special.intersection(words) else line


def check_dense_ids(tok: Tokenizer, source: str) -> None:
    """Raise unless the vocabulary's ids are exactly ``0 .. vocab_size - 1`` and every special token has one."""
    vocab = tok.get_vocab()
    ids = sorted(vocab.values())
    size = tok.get_vocab_size()
    if ids != list(range(size)):
        missing = sorted(set(range(size)) - set(ids))[:5]
        beyond = [i for i in ids if i >= size][:5]
        raise ValueError(
            f"{source}: vocabulary ids are not dense in [0, {size}) (missing {missing}, at or beyond the size"
            f" {beyond}); an embedding of {size} rows would fail on them. Delete the file to retrain it."
        )
    absent = [t for t in SPECIAL_TOKENS if t not in vocab]
    if absent:
        raise ValueError(f"{source}: the special tokens {absent} have no id")


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (POSIX ``flock``; no lock where there is none)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: ranks may each train; the atomic rename still keeps the file whole
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def train_tokenizer(lines: Iterable[str], kind: str, max_vocab_size: int, min_frequency: int = 1) -> Tokenizer:
    """Train a tokenizer on whitespace-separated text.

    Args:
        lines: training text, one sentence per item.
        kind: ``"word"``: one id per word, the ``max_vocab_size - 3`` most frequent words plus
            ``<unk>``, ``<eos>``, ``<pad>``; ``"bpe"``: byte-pair merges up to ``max_vocab_size``.
        max_vocab_size: vocabulary cap, special tokens included.
        min_frequency: words (or merges) seen fewer times map to ``<unk>`` (are not learned).
    """
    if kind == "word":
        tok = Tokenizer(models.WordLevel(unk_token=UNK))
        trainer = trainers.WordLevelTrainer(
            vocab_size=max_vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS)
        )
    elif kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token=UNK))
        trainer = trainers.BpeTrainer(
            vocab_size=max_vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS)
        )
    else:
        raise ValueError(f"tokenizer={kind!r} is not supported; choose one of {TOKENIZER_KINDS}")
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(_without_special_tokens(lines), trainer)
    check_dense_ids(tok, f"the {kind} tokenizer just trained")
    return tok


def load_tokenizer(
    data_key: str,
    lines: Iterable[str],
    *,
    kind: str,
    max_vocab_size: int,
    min_frequency: int,
    cache_dir: str | os.PathLike | None = None,
) -> Tokenizer:
    """The tokenizer for the train text ``lines``, from the cache when its key matches, else trained and cached.

    The key hashes ``data_key`` (a digest of the train text, e.g. :func:`file_digest`), the settings
    and the tokenizers version. Processes that start together (every rank under ``mpiexec`` or
    ``torchrun``, each its own node) take an exclusive lock in ``cache_dir`` (default
    :func:`default_cache_dir`): the first trains, the others wait and load its file. The file is
    written to a temporary name and renamed into place, so a failure never leaves a partial file
    behind. Loaded or trained, the ids are checked dense (:func:`check_dense_ids`).
    """
    settings = {"kind": kind, "max_vocab_size": max_vocab_size, "min_frequency": min_frequency}
    key_src = json.dumps({**settings, "data": data_key, "tokenizers": tokenizers.__version__})
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache_dir / f"tokenizer-{kind}-{key}.json"
    if path.is_file():  # the common case needs no lock: the file only ever appears whole
        return _load_checked(path)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache_dir / f".tokenizer-{kind}-{key}.lock"):
        if path.is_file():  # another process trained it while this one waited
            return _load_checked(path)
        tok = train_tokenizer(lines, kind, max_vocab_size, min_frequency)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".tokenizer-", suffix=".tmp")
        os.close(fd)
        try:
            tok.save(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    log.info("tokenizer trained (%d entries) and cached at %s", tok.get_vocab_size(), path)
    return tok


def _load_checked(path: Path) -> Tokenizer:
    log.info("tokenizer from cache %s", path)
    tok = Tokenizer.from_file(str(path))
    check_dense_ids(tok, str(path))
    return tok


def encode_stream(tok: Tokenizer, lines: Sequence[str]) -> Tensor:
    """One token stream: every non-blank line's ids followed by ``<eos>`` (int64)."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch([line for line in lines if line.strip()]):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


class StreamWindows(Dataset):
    """Consecutive non-overlapping windows of a token stream for next-token prediction.

    Item ``i`` is ``(x, y)`` with ``x = stream[iL : iL+L]`` and ``y = stream[iL+1 : iL+L+1]``. The
    last window is padded: ``x`` with ``pad_id``, ``y`` with ``IGNORE_INDEX`` (-100), which the loss
    and perplexity skip, so padding never changes them.
    """

    def __init__(self, stream: Tensor, seq_len: int, pad_id: int) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be > 0, got {seq_len}")
        if stream.numel() < 2:
            raise ValueError("the token stream needs at least 2 tokens")
        self.stream = stream
        self.seq_len = seq_len
        self.pad_id = pad_id

    def __len__(self) -> int:
        return -(-(self.stream.numel() - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        start = i * self.seq_len
        x = self.stream[start : start + self.seq_len]
        y = self.stream[start + 1 : start + self.seq_len + 1]
        if y.numel() < self.seq_len:
            pad = self.seq_len - y.numel()
            x = torch.cat([x[: y.numel()], x.new_full((pad,), self.pad_id)])
            y = torch.cat([y, y.new_full((pad,), IGNORE_INDEX)])
        return x, y


def encode_sentences(tok: Tokenizer, lines: Sequence[str]) -> list[Tensor]:
    """One int64 tensor per non-blank line: ``<eos>`` (the sentence start), its ids, ``<eos>``."""
    eos = tok.token_to_id(EOS)
    return [
        torch.tensor([eos, *enc.ids, eos], dtype=torch.int64)
        for enc in tok.encode_batch([line for line in lines if line.strip()])
    ]


class SentencePieces(Dataset):
    """Every sentence on its own, for next-token prediction without crossing sentence boundaries.

    A sentence is ``[<eos>, w_1, ..., w_n, <eos>]``: the first ``<eos>`` stands for the start, so
    all ``n + 1`` following tokens are predicted from the sentence alone. A sentence with more than
    ``max_len`` predictions is cut into consecutive pieces of ``max_len`` (the next piece's input
    starts with the token the previous one predicted last), so no token is lost and no example is
    longer than the model accepts. Items are unpadded ``(x, y)`` pairs of equal length;
    :class:`PadCollate` pads a batch of them.
    """

    def __init__(self, sentences: Sequence[Tensor], max_len: int) -> None:
        if max_len <= 0:
            raise ValueError(f"max_len must be > 0, got {max_len}")
        if not sentences:
            raise ValueError("no sentences")
        self.sentences = list(sentences)
        self.max_len = max_len
        # (sentence, first position) of every piece
        self.index = [
            (i, start) for i, s in enumerate(self.sentences) for start in range(0, max(s.numel() - 1, 0), max_len)
        ]
        if not self.index:
            raise ValueError("no sentence has a token to predict")
        self.lengths = torch.tensor(
            [min(self.max_len, self.sentences[i].numel() - 1 - start) for i, start in self.index]
        )

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, j: int) -> tuple[Tensor, Tensor]:
        i, start = self.index[j]
        s = self.sentences[i]
        n = int(self.lengths[j])
        return s[start : start + n], s[start + 1 : start + n + 1]


class PadCollate:
    """Stacks ``(x, y)`` pairs of different lengths: ``x`` right-padded with ``pad_id``, ``y`` with
    ``IGNORE_INDEX``. With causal models (the LSTM, the Transformer's causal attention) a real position
    never sees a padded one to its right and padded targets are skipped by the loss and the
    perplexity, so a padded batch gives the loss and gradients of its sentences taken one by one
    (token-weighted: the batch loss is the mean over all of its real tokens)."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, items: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        width = max(x.numel() for x, _ in items)
        x = torch.full((len(items), width), self.pad_id, dtype=torch.int64)
        y = torch.full((len(items), width), IGNORE_INDEX, dtype=torch.int64)
        for row, (xi, yi) in enumerate(items):
            x[row, : xi.numel()] = xi
            y[row, : yi.numel()] = yi
        return x, y


def bucket_batches(lengths: Tensor, batch_size: int, pool_batches: int, seed: int, drop_last: bool) -> list[Tensor]:
    """Index batches of examples of similar length: the examples are shuffled (``seed``), cut into
    pools of ``pool_batches`` batches, each pool sorted by length and cut into batches. Sorting within
    a pool only, not over the whole split, keeps the batches' contents random from epoch to epoch of
    the pools while cutting most of the padding; the order of the batches is left to the loader."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    if pool_batches <= 0:
        raise ValueError(f"pool_batches must be > 0, got {pool_batches}")
    order = torch.randperm(lengths.numel(), generator=torch.Generator().manual_seed(seed))
    pool = batch_size * pool_batches
    batches = []
    for p in range(0, order.numel(), pool):
        members = order[p : p + pool]
        members = members[torch.argsort(lengths[members], stable=True)]
        batches.extend(members.split(batch_size))
    if drop_last:
        batches = [b for b in batches if b.numel() == batch_size]
    return batches


class BucketedBatches(Dataset):
    """A dataset whose items are whole padded batches (given as index batches of ``pieces``), so a
    ``DistributedSampler`` shards and shuffles batches, not examples (load with ``batch_size=None``)."""

    def __init__(self, pieces: Dataset, batches: Sequence[Tensor], pad_id: int) -> None:
        if not batches:
            raise ValueError("no batch: fewer examples than one batch")
        self.pieces = pieces
        self.batches = list(batches)
        self.collate = PadCollate(pad_id)

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.collate([self.pieces[int(j)] for j in self.batches[i]])


def padding_fraction(batches: Iterable[tuple[Tensor, Tensor]]) -> float:
    """Share of the positions of these batches whose target is padding."""
    pad = total = 0
    for _, y in batches:
        pad += int((y == IGNORE_INDEX).sum())
        total += y.numel()
    return pad / max(total, 1)


class NGramWindows(Dataset):
    """Every token of a stream with its ``order - 1`` predecessors, for a feed-forward n-gram LM.

    Item ``i`` is ``(context, target)``: ``context`` holds the ``order - 1`` tokens before token ``i``
    (the stream's start is preceded by ``<eos>``, as if a sentence had just ended), ``target`` is a
    1-element tensor with token ``i``.
    """

    def __init__(self, stream: Tensor, order: int, eos_id: int) -> None:
        if order < 2:
            raise ValueError(f"n-gram order must be >= 2, got {order}")
        self.order = order
        self.stream = stream
        self.padded = torch.cat([stream.new_full((order - 1,), eos_id), stream])

    def __len__(self) -> int:
        return self.stream.numel()

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.padded[i : i + self.order - 1], self.stream[i : i + 1]
