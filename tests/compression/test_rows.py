import pytest
import torch

from lightning_commstrats.compression import batch_token_ids, most_frequent, random_rows, resolve_count, union


def test_resolve_count_takes_counts_and_fractions():
    assert resolve_count(10, 100, "alpha") == 10
    assert resolve_count(0.25, 100, "alpha") == 25
    assert resolve_count(1.0, 100, "beta") == 100
    with pytest.raises(ValueError, match="alpha=101 must be between 0 and the vocabulary size 100"):
        resolve_count(101, 100, "alpha")
    with pytest.raises(ValueError, match=r"beta=1.5 as a fraction must be in \[0, 1\]"):
        resolve_count(1.5, 100, "beta")
    with pytest.raises(ValueError, match="alpha=-1"):
        resolve_count(-1, 100, "alpha")


def test_batch_ids_come_from_every_integer_tensor_and_skip_ignored_targets():
    x = torch.tensor([[1, 2], [3, 1]])
    y = torch.tensor([[2, 7], [-100, 9]])
    batch = (x, {"y": y, "weights": torch.rand(2)})
    assert batch_token_ids(batch, vocab_size=8).tolist() == [1, 2, 3, 7]


def test_most_frequent_and_random_rows():
    counts = torch.tensor([5.0, 1.0, 9.0, 5.0, 0.0])
    assert most_frequent(counts, 3).tolist() == [0, 2, 3]
    a = random_rows(1000, 20, seed=1, step=7)
    assert torch.equal(a, random_rows(1000, 20, seed=1, step=7))  # what another rank draws
    assert not torch.equal(a, random_rows(1000, 20, seed=1, step=8))
    assert a.unique().numel() == 20 and a.max() < 1000
    assert union(torch.tensor([3, 1]), torch.tensor([1, 2])).tolist() == [1, 2, 3]
