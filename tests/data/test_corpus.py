import gzip
import json
import math
import multiprocessing
import time
from pathlib import Path

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
    files = sorted(cache.glob("*.json"))
    assert len(files) == 1
    mtime = files[0].stat().st_mtime_ns
    t2 = load_tokenizer("k1", [], kind="word", max_vocab_size=10, min_frequency=1, cache_dir=cache)  # from cache
    assert t2.get_vocab() == t1.get_vocab() and files[0].stat().st_mtime_ns == mtime
    load_tokenizer("k2", lines, kind="word", max_vocab_size=10, min_frequency=1, cache_dir=cache)
    load_tokenizer("k1", lines, kind="word", max_vocab_size=4, min_frequency=1, cache_dir=cache)
    load_tokenizer("k1", lines, kind="bpe", max_vocab_size=10, min_frequency=1, cache_dir=cache)
    assert len(list(cache.glob("*.json"))) == 4


def test_failed_cache_write_leaves_nothing(tmp_path, monkeypatch):
    def broken_save(self, path, pretty=True):
        with open(path, "w") as f:
            f.write("{half")
        raise OSError("disk full")

    monkeypatch.setattr(Tokenizer, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        load_tokenizer("k", ["a b"], kind="word", max_vocab_size=5, min_frequency=1, cache_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.parametrize("kind", ["word", "bpe"])
def test_a_corpus_that_writes_unk_itself_gets_dense_ids(tmp_path, kind):
    # the standard word-level LM corpora (Penn Treebank, WikiText) already replaced rare words by <unk>
    train = "the cat <unk> sat\na <unk> dog <unk>\nthe the cat\n" * 3
    dm = LMDataModule(
        data_dir=str(write_corpus(tmp_path / "c", train=train, valid="the <unk> zebra\n")),
        tokenizer=kind,
        max_vocab_size=60,
        cache_dir=str(tmp_path / "cache"),
    )
    ids = sorted(dm.tokenizer.get_vocab().values())
    assert ids == list(range(dm.vocab_size))
    unk = dm.tokenizer.token_to_id("<unk>")
    for split in ("train", "valid"):
        assert int(dm.stream(split).max()) < dm.vocab_size
    valid = dm.stream("valid").tolist()
    assert valid.count(unk) >= 1 and valid[-1] == dm.eos_id
    if kind == "word":  # the literal and the unseen word are both the special token
        assert valid == [dm.tokenizer.token_to_id("the"), unk, unk, dm.eos_id]
        torch.nn.Embedding(dm.vocab_size, 4)(dm.stream("train"))  # what failed on the first batch


def test_a_cached_tokenizer_with_holes_is_refused_by_name(tmp_path):
    cache = tmp_path / "cache"
    load_tokenizer("k", ["a b c"], kind="word", max_vocab_size=10, min_frequency=1, cache_dir=cache)
    (path,) = [p for p in cache.iterdir() if p.suffix == ".json"]
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    vocab["c"] = len(vocab) + 3  # a hole and an id beyond the size, as the old trainer wrote them
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"{path.name}: vocabulary ids are not dense"):
        load_tokenizer("k", [], kind="word", max_vocab_size=10, min_frequency=1, cache_dir=cache)


def _load_in_process(cache, marks, index):
    def lines():
        (marks / f"trained-{index}").touch()  # only a process that trains reads the text
        time.sleep(0.5)  # long enough for every other process to find no cache file
        yield from ["a b c a", "b a"]

    tok = load_tokenizer("k", lines(), kind="word", max_vocab_size=10, min_frequency=1, cache_dir=cache)
    (marks / f"vocab-{index}.json").write_text(json.dumps(tok.get_vocab()))


def test_processes_that_start_together_train_once_and_share_the_file(tmp_path):
    cache, marks = tmp_path / "cache", tmp_path / "marks"
    marks.mkdir()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_load_in_process, args=(cache, marks, i)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert len(list(marks.glob("trained-*"))) == 1
    vocabs = [json.loads(p.read_text()) for p in sorted(marks.glob("vocab-*.json"))]
    assert len(vocabs) == 3 and vocabs[0] == vocabs[1] == vocabs[2]
    assert len(list(cache.glob("*.json"))) == 1


def test_default_cache_is_outside_the_package(tmp_path, monkeypatch):
    import lightning_commstrats

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    dm = LMDataModule(data_dir=str(write_corpus(tmp_path / "c")))
    assert dm.cache_dir == tmp_path / "xdg" / "lightning_commstrats" / "tokenizers"
    dm.vocab_size  # noqa: B018
    assert len(list(dm.cache_dir.glob("tokenizer-word-*.json"))) == 1
    package = Path(lightning_commstrats.__file__).parent
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert package not in LMDataModule().cache_dir.parents


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
        ({"mode": "words"}, "mode='words' is not supported"),
        ({"bucket_by_length": True}, "bucket_by_length=True needs mode='sentences', got mode='stream'"),
        ({"mode": "sentences", "bucket_pool": 0}, "bucket_pool must be > 0, got 0"),
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
