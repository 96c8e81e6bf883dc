"""Corpora and the language-modelling DataModule (the Brown corpus ships with the package)."""

from lightning_commstrats.data.corpus import (
    BROWN_DIR,
    IGNORE_INDEX,
    NGramWindows,
    PadCollate,
    SentencePieces,
    StreamWindows,
    bucket_batches,
    check_text_file,
    encode_sentences,
    encode_stream,
    load_tokenizer,
    train_tokenizer,
)
from lightning_commstrats.data.datamodule import LMDataModule

__all__ = [
    "BROWN_DIR",
    "IGNORE_INDEX",
    "LMDataModule",
    "NGramWindows",
    "PadCollate",
    "SentencePieces",
    "StreamWindows",
    "bucket_batches",
    "check_text_file",
    "encode_sentences",
    "encode_stream",
    "load_tokenizer",
    "train_tokenizer",
]
