"""Corpora and the language-modelling DataModule (the Brown corpus ships with the package)."""

from lightning_commstrats.data.corpus import (
    BROWN_DIR,
    IGNORE_INDEX,
    NGramWindows,
    StreamWindows,
    check_text_file,
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
    "StreamWindows",
    "check_text_file",
    "encode_stream",
    "load_tokenizer",
    "train_tokenizer",
]
