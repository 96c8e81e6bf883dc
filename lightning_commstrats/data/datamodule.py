"""The language-modelling DataModule: the Brown corpus by default, any text files or hub dataset."""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_commstrats.data.corpus import (
    BROWN_DIR,
    EOS,
    PAD,
    TOKENIZER_KINDS,
    BucketedBatches,
    NGramWindows,
    PadCollate,
    SentencePieces,
    StreamWindows,
    bucket_batches,
    check_text_file,
    default_cache_dir,
    encode_sentences,
    encode_stream,
    file_digest,
    load_tokenizer,
)

log = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")
MODES = ("stream", "ngram", "sentences")


def _find(data_dir: Path, split: str) -> Path:
    for name in (f"{split}.txt", f"{split}.txt.gz"):
        if (data_dir / name).is_file():
            return data_dir / name
    raise FileNotFoundError(f"data file not found: {data_dir / (split + '.txt')} (nor {split}.txt.gz)")


class LMDataModule(L.LightningDataModule):
    """Word-level (or BPE) language-modelling data from a text corpus, one sentence per line.

    Text is loaded with ``datasets`` (``load_dataset("text", data_files=...)`` for local files, or a
    hub dataset by name when online), tokenized with a ``tokenizers`` model trained on the train
    split and cached next to the data, and served as contiguous windows (``mode="stream"``, for
    the LSTM and Transformer LMs), n-gram contexts (``mode="ngram"``, for the feed-forward LM), or
    one sentence per example (``mode="sentences"``, for the LSTM and Transformer LMs): each
    sentence starts from a fresh state, batches are right-padded to their longest sentence and the
    padding is masked, so a batch gives the loss and gradients of its sentences taken one by one.
    ``bucket_by_length`` groups sentences of similar length into batches to cut the padding.

    Under a distributed strategy Lightning shards every split with a ``DistributedSampler``: each
    rank reads only its own partition (CNTK's ``distributedMBReading``), reshuffled each epoch from
    the global seed, so runs are deterministic per seed.

    Args:
        data_dir: folder with ``train.txt``, ``valid.txt``, ``test.txt`` (``.gz`` allowed); default:
            the Brown corpus shipped with the package.
        dataset_name: a hub dataset with a ``text`` column instead of ``data_dir`` (needs network).
        dataset_config: its configuration name, e.g. ``"wikitext-2-raw-v1"``.
        tokenizer: ``"word"`` (the paper's word vocabulary with ``<unk>``) or ``"bpe"``.
        max_vocab_size: vocabulary cap, special tokens included (the paper: about 49k, all words).
        min_frequency: rarer words map to ``<unk>``.
        mode: ``"stream"``, ``"ngram"`` or ``"sentences"``.
        seq_len: tokens per window in stream mode (BPTT length); in sentences mode the most
            predictions per example (longer sentences are cut into consecutive pieces).
        bucket_by_length: sentences mode only: batches of sentences of similar length, formed once
            per split (seeded by ``bucket_seed``) within pools of ``bucket_pool`` batches; the
            loader shuffles the order of the batches each epoch (and shards them over ranks).
        bucket_pool: batches per pool sorted by length.
        bucket_seed: seed of the grouping.
        order: n-gram order in ngram mode (5: four context words).
        batch_size: examples per batch and rank.
        num_workers: DataLoader workers.
        cache_dir: where the tokenizer is cached; default ``~/.cache/lightning_commstrats/tokenizers``
            (``$XDG_CACHE_HOME`` honoured; never inside the installed package). File names carry a
            key of the corpus bytes and the settings, so one folder serves every corpus.
    """

    def __init__(
        self,
        data_dir: str | None = None,
        dataset_name: str | None = None,
        dataset_config: str | None = None,
        tokenizer: str = "word",
        max_vocab_size: int = 10000,
        min_frequency: int = 1,
        mode: str = "stream",
        seq_len: int = 35,
        order: int = 5,
        batch_size: int = 64,
        num_workers: int = 0,
        cache_dir: str | None = None,
        bucket_by_length: bool = False,
        bucket_pool: int = 50,
        bucket_seed: int = 0,
    ) -> None:
        super().__init__()
        if tokenizer not in TOKENIZER_KINDS:
            raise ValueError(f"tokenizer={tokenizer!r} is not supported; choose one of {TOKENIZER_KINDS}")
        if max_vocab_size < 2:
            raise ValueError(f"max_vocab_size must be >= 2, got {max_vocab_size}")
        if min_frequency < 1:
            raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not supported; choose one of {MODES}")
        if seq_len <= 0:
            raise ValueError(f"seq_len must be > 0, got {seq_len}")
        if order < 2:
            raise ValueError(f"order (n-gram order) must be >= 2, got {order}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
        if bucket_by_length and mode != "sentences":
            raise ValueError(f"bucket_by_length=True needs mode='sentences', got mode={mode!r}")
        if bucket_pool <= 0:
            raise ValueError(f"bucket_pool must be > 0, got {bucket_pool}")
        if data_dir is not None and dataset_name is not None:
            raise ValueError("give data_dir or dataset_name, not both")
        self.save_hyperparameters()
        self.dataset_name = dataset_name
        self.dataset_config = dataset_config
        self.tokenizer_kind = tokenizer
        self.max_vocab_size = max_vocab_size
        self.min_frequency = min_frequency
        self.mode = mode
        self.seq_len = seq_len
        self.order = order
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.bucket_by_length = bucket_by_length
        self.bucket_pool = bucket_pool
        self.bucket_seed = bucket_seed
        self.files: dict[str, Path] = {}
        if dataset_name is None:
            root = Path(data_dir) if data_dir is not None else BROWN_DIR
            self.files = {split: _find(root, split) for split in SPLITS}
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self._text: dict[str, list[str]] | None = None
        self._tokenizer = None
        self._streams: dict[str, Tensor] = {}

    # ------------------------------------------------------------------ text and tokenizer

    def text(self, split: str) -> list[str]:
        """The split's lines (blank ones dropped), loaded with ``datasets`` after the files are checked."""
        if self._text is None:
            import datasets

            if self.dataset_name is None:
                for path in self.files.values():
                    check_text_file(path)
                data_files = {
                    "train": str(self.files["train"]),
                    "validation": str(self.files["valid"]),
                    "test": str(self.files["test"]),
                }
                ds = datasets.load_dataset("text", data_files=data_files)
            else:
                ds = datasets.load_dataset(self.dataset_name, self.dataset_config)
            names = {"train": "train", "valid": "validation", "test": "test"}
            self._text = {s: [t for t in ds[names[s]]["text"] if t.strip()] for s in SPLITS}
            for s in SPLITS:
                if not self._text[s]:
                    raise ValueError(f"the {s} split of {self.dataset_name or self.files[s]} has no text")
        return self._text[split]

    @property
    def tokenizer(self):
        """The trained (or cached) ``tokenizers.Tokenizer``."""
        if self._tokenizer is None:
            train = self.text("train")
            if self.files:
                data_key = file_digest([self.files["train"]])
            else:
                data_key = hashlib.sha256("\n".join(train).encode()).hexdigest()
            self._tokenizer = load_tokenizer(
                data_key,
                train,
                kind=self.tokenizer_kind,
                max_vocab_size=self.max_vocab_size,
                min_frequency=self.min_frequency,
                cache_dir=self.cache_dir,
            )
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Entries in the vocabulary, special tokens included (at most ``max_vocab_size``)."""
        return self.tokenizer.get_vocab_size()

    @property
    def pad_id(self) -> int:
        return self.tokenizer.token_to_id(PAD)

    @property
    def eos_id(self) -> int:
        return self.tokenizer.token_to_id(EOS)

    def stream(self, split: str) -> Tensor:
        """The split as one int64 token stream with ``<eos>`` after every sentence."""
        if split not in self._streams:
            self._streams[split] = encode_stream(self.tokenizer, self.text(split))
        return self._streams[split]

    @property
    def word_counts(self) -> Tensor:
        """How often each vocabulary entry occurs in the train stream (``<eos>`` included), shape ``[V]``."""
        return torch.bincount(self.stream("train"), minlength=self.vocab_size)

    def unigram_perplexity(self, split: str = "valid") -> float:
        """Perplexity of the add-one unigram model of the train split on ``split`` (same vocabulary).

        The baseline a context model must beat: it knows word frequencies and nothing else.
        """
        counts = self.word_counts.double() + 1.0
        log_p = counts.log() - counts.sum().log()
        return math.exp(-log_p[self.stream(split)].mean().item())

    # ------------------------------------------------------------------ Lightning hooks

    def prepare_data(self) -> None:
        self.tokenizer  # noqa: B018 - trains and caches once, on the first rank of each node

    def dataset(self, split: str) -> Dataset:
        """The split's examples (in sentences mode unpadded; :meth:`loader` pads them per batch)."""
        if self.mode == "sentences":
            return SentencePieces(encode_sentences(self.tokenizer, self.text(split)), self.seq_len)
        s = self.stream(split)
        if self.mode == "stream":
            return StreamWindows(s, self.seq_len, self.pad_id)
        return NGramWindows(s, self.order, self.eos_id)

    def loader(self, split: str, train: bool) -> DataLoader:
        """The split's DataLoader: shuffled with whole batches only for training."""
        data = self.dataset(split)
        if self.mode == "sentences" and self.bucket_by_length:
            batches = bucket_batches(data.lengths, self.batch_size, self.bucket_pool, self.bucket_seed, drop_last=train)
            return DataLoader(
                BucketedBatches(data, batches, self.pad_id),
                batch_size=None,
                shuffle=train,
                num_workers=self.num_workers,
            )
        return DataLoader(
            data,
            batch_size=self.batch_size,
            shuffle=train,
            num_workers=self.num_workers,
            drop_last=train,
            collate_fn=PadCollate(self.pad_id) if self.mode == "sentences" else None,
        )

    def train_dataloader(self) -> DataLoader:
        return self.loader("train", train=True)

    def val_dataloader(self) -> DataLoader:
        return self.loader("valid", train=False)

    def test_dataloader(self) -> DataLoader:
        return self.loader("test", train=False)
