import gzip
import math

import pytest
import torch
from tokenizers import Tokenizer

from lightning_commstrats.data import (
    IGNORE_INDEX,
    LMDataModule,
    NGramWindows,
    StreamWindows,
    check_text_file,
    load_tokenizer,
)
from lightning_commstrats.data.corpus import file_digest


def write_corpus(root, train="a b c a b\nb c a\n", valid="a b c\n", test="c b a\n"):
    root.mkdir(parents=True, exist_ok=True)
    for name, text in (("train", train), ("valid", valid), ("test", test)):
        (root / f"{name}.txt").write_text(text)
    return root


def test_check_text_file_names_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"data file not found: {tmp_path / 'nope.txt'}"):
        check_text_file(tmp_path / "nope.txt")
    (tmp_path / "blank.txt").write_text("\n  \n")
    with pytest.raises(ValueError, match=r"blank\.txt is empty"):
        check_text_file(tmp_path / "blank.txt")
    (tmp_path / "bad.txt").write_bytes(b"fine\nalso fine\nbad \xff byte\n")
    with pytest.raises(ValueError, match=r"bad.txt, line 3: bytes that are not UTF-8"):
        check_text_file(tmp_path / "bad.txt")
    with gzip.open(tmp_path / "ok.txt.gz", "wt") as f:
        f.write("one\n\ntwo\n")
    assert check_text_file(tmp_path / "ok.txt.gz") == 2


def test_tokenizer_cache_key_follows_corpus_and_settings(tmp_path):
    lines = ["a b c a", "b a"]
    cache = tmp_path / "cache"
    t1 = load_tokenizer("k1", lines, kind="word", max_vocab_size=10, min_frequency=1, cache_dir=cache)
    files = sorted(cache.iterdir())
    assert len(files) == 1
    mtime = files[0].stat().st_mtime_ns
    t2 = load_tokenizer("k1", [], kind="word", max_vocab_size=10, min_frequency=1, cache_dir=cache)  # from cache
    assert t2.get_vocab() == t1.get_vocab() and files[0].stat().st_mtime_ns == mtime
    load_tokenizer("k2", lines, kind="word", max_vocab_size=10, min_frequency=1, cache_dir=cache)
    load_tokenizer("k1", lines, kind="word", max_vocab_size=4, min_frequency=1, cache_dir=cache)
    load_tokenizer("k1", lines, kind="bpe", max_vocab_size=10, min_frequency=1, cache_dir=cache)
    assert len(list(cache.iterdir())) == 4


def test_failed_cache_write_leaves_nothing(tmp_path, monkeypatch):
    def broken_save(self, path, pretty=True):
        with open(path, "w") as f:
            f.write("{half")
        raise OSError("disk full")

    monkeypatch.setattr(Tokenizer, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        load_tokenizer("k", ["a b"], kind="word", max_vocab_size=5, min_frequency=1, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_word_vocabulary_keeps_the_most_frequent_words(tmp_path):
    dm = LMDataModule(data_dir=str(write_corpus(tmp_path / "c", train="a a a b b c\n")), max_vocab_size=5)
    vocab = dm.tokenizer.get_vocab()
    assert dm.vocab_size == 5 and {"<unk>", "<eos>", "<pad>", "a", "b"} == set(vocab)
    stream = dm.stream("train")
    assert stream.tolist() == [vocab[w] for w in "a a a b b".split()] + [vocab["<unk>"], vocab["<eos>"]]
    assert dm.word_counts.sum() == stream.numel()


def test_unigram_perplexity_by_hand(tmp_path):
    dm = LMDataModule(data_dir=str(write_corpus(tmp_path / "c", train="a a b\n", valid="a b\n")), max_vocab_size=10)
    v = dm.tokenizer.get_vocab()
    counts = {w: 1.0 for w in v}  # add-one
    counts["a"] += 2
    counts["b"] += 1
    counts["<eos>"] += 1
    total = sum(counts.values())
    expected = math.exp(-sum(math.log(counts[w] / total) for w in ("a", "b", "<eos>")) / 3)
    assert dm.unigram_perplexity("valid") == pytest.approx(expected)


def test_stream_windows_pad_the_last_window_with_ignored_targets():
    stream = torch.arange(10)
    ds = StreamWindows(stream, seq_len=4, pad_id=99)
    assert len(ds) == 3  # 9 predictions in windows of 4
    x, y = ds[0]
    assert x.tolist() == [0, 1, 2, 3] and y.tolist() == [1, 2, 3, 4]
    x, y = ds[2]
    assert x.tolist() == [8, 99, 99, 99] and y.tolist() == [9, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]


def test_ngram_windows_see_exactly_the_previous_words():
    stream = torch.tensor([5, 6, 7, 8])
    ds = NGramWindows(stream, order=3, eos_id=1)
    assert len(ds) == 4
    assert [ds[i][0].tolist() for i in range(4)] == [[1, 1], [1, 5], [5, 6], [6, 7]]
    assert [ds[i][1].item() for i in range(4)] == [5, 6, 7, 8]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_vocab_size": 1}, "max_vocab_size must be >= 2, got 1"),
        ({"seq_len": 0}, "seq_len must be > 0, got 0"),
        ({"order": 1}, r"order \(n-gram order\) must be >= 2, got 1"),
        ({"tokenizer": "char"}, "tokenizer='char' is not supported"),
        ({"mode": "sentences"}, "mode='sentences' is not supported"),
    ],
)
def test_bad_settings_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LMDataModule(**kwargs)


def test_bad_data_fails_before_training_and_caches_nothing(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "missing" / "train.txt")):
        LMDataModule(data_dir=str(tmp_path / "missing"))
    bad = write_corpus(tmp_path / "bad", valid="ok\n\xff\n".encode("latin-1").decode("latin-1"))
    (bad / "valid.txt").write_bytes(b"ok\n\xff\n")
    dm = LMDataModule(data_dir=str(bad), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"valid.txt, line 2: bytes that are not UTF-8"):
        dm.vocab_size  # noqa: B018
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []
    empty = write_corpus(tmp_path / "empty", train="\n\n")
    with pytest.raises(ValueError, match=r"train\.txt is empty"):
        LMDataModule(data_dir=str(empty)).vocab_size  # noqa: B018


def test_shipped_brown_corpus_matches_its_readme():
    from lightning_commstrats.data import BROWN_DIR

    assert check_text_file(BROWN_DIR / "train.txt.gz") == 40000
    assert check_text_file(BROWN_DIR / "valid.txt.gz") == 8670
    assert check_text_file(BROWN_DIR / "test.txt.gz") == 8670
    assert "redistribution permitted" in (BROWN_DIR / "README.nltk_data").read_text()
    assert len(file_digest([BROWN_DIR / "train.txt.gz"])) == 64
