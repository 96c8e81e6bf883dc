"""Sentence batches: padding never changes the loss or the gradients, and bucketing cuts the padding."""

import pytest
import torch
from torch.nn import functional as F

from lightning_commstrats.cli import check_model_and_data
from lightning_commstrats.data import IGNORE_INDEX, LMDataModule, PadCollate, SentencePieces, bucket_batches
from lightning_commstrats.data.corpus import padding_fraction
from lightning_commstrats.models.module import build_model, lm_loss

VOCAB, PAD, EOS = 40, 39, 1


def sentences(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.cat([torch.tensor([EOS]), torch.randint(2, VOCAB - 1, (n,), generator=g), torch.tensor([EOS])])
        for n in lengths
    ]


def model(arch):
    torch.manual_seed(0)
    kwargs = dict(embed_dim=8, hidden_dim=8, num_layers=2, dropout=0.0, tie_weights=False, order=3)
    return build_model(arch, VOCAB, num_heads=2, ffn_dim=16, max_seq_len=16, **kwargs).double()


@pytest.mark.parametrize("arch", ["lstm", "transformer"])
def test_a_padded_batch_gives_the_loss_and_gradients_of_its_sentences_one_by_one(arch):
    net = model(arch)
    pieces = SentencePieces(sentences([3, 9, 1, 14, 6]), max_len=16)
    x, y = PadCollate(PAD)([pieces[i] for i in range(len(pieces))])
    assert x.shape == (5, 15) and (y == IGNORE_INDEX).sum() == 5 * 15 - (4 + 10 + 2 + 15 + 7)
    params = list(net.parameters())
    batch_loss = lm_loss(net(x), y)
    batch_grads = torch.autograd.grad(batch_loss, params)

    # the reference: every sentence alone, unpadded; the batch loss is the mean over all real tokens
    total, tokens = 0.0, 0
    for i in range(len(pieces)):
        xi, yi = pieces[i]
        total = total + F.cross_entropy(net(xi[None])[0].float(), yi, reduction="sum")  # lm_loss's float32
        tokens += yi.numel()
    ref_loss = total / tokens
    ref_grads = torch.autograd.grad(ref_loss, params)
    torch.testing.assert_close(batch_loss, ref_loss, rtol=1e-6, atol=1e-7)
    for got, want in zip(batch_grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_long_sentences_are_cut_into_pieces_that_predict_every_token_once():
    (s,) = sentences([10])  # 12 tokens, 11 predictions
    pieces = SentencePieces([s], max_len=4)
    assert len(pieces) == 3 and pieces.lengths.tolist() == [4, 4, 3]
    xs, ys = zip(*(pieces[i] for i in range(3)), strict=True)
    assert torch.equal(torch.cat(ys), s[1:]) and torch.equal(torch.cat(xs), s[:-1])


def test_bucketing_keeps_every_example_once_and_sorts_within_pools():
    lengths = torch.randint(1, 50, (1000,), generator=torch.Generator().manual_seed(1))
    batches = bucket_batches(lengths, batch_size=8, pool_batches=10, seed=0, drop_last=False)
    assert sorted(torch.cat(batches).tolist()) == list(range(1000))
    for p in range(0, len(batches), 10):  # within a pool the batches run from short to long
        pool = torch.cat(batches[p : p + 10])
        assert torch.equal(lengths[pool], lengths[pool].sort().values)
    kept = bucket_batches(lengths, batch_size=8, pool_batches=3, seed=0, drop_last=True)
    assert all(b.numel() == 8 for b in kept)
    assert bucket_batches(lengths, 8, 10, seed=1, drop_last=False)[0].tolist() != batches[0].tolist()


@pytest.fixture(scope="module")
def brown_sentences(tmp_path_factory):
    cache = tmp_path_factory.mktemp("tok")
    plain = LMDataModule(mode="sentences", batch_size=32, seq_len=60, max_vocab_size=2000, cache_dir=str(cache))
    bucketed = LMDataModule(
        mode="sentences", batch_size=32, seq_len=60, max_vocab_size=2000, cache_dir=str(cache), bucket_by_length=True
    )
    return plain, bucketed


def test_brown_in_sentences_mode_with_and_without_buckets(brown_sentences):
    plain, bucketed = brown_sentences
    # both loaders serve the same examples; every validation token is there once
    valid = plain.dataset("valid")
    tokens = sum(int((y != IGNORE_INDEX).sum()) for _, y in plain.val_dataloader())
    assert (
        tokens == int(valid.lengths.sum()) == sum(int((y != IGNORE_INDEX).sum()) for _, y in bucketed.val_dataloader())
    )
    assert tokens == plain.stream("valid").numel()  # each sentence's words and its <eos>: the stream's tokens
    x, y = next(iter(bucketed.train_dataloader()))
    assert x.shape[0] == 32 and x.shape == y.shape and x.shape[1] <= 60
    plain_pad = padding_fraction(plain.val_dataloader())
    bucket_pad = padding_fraction(bucketed.val_dataloader())
    assert plain_pad > 0.3 and bucket_pad < 0.05, (plain_pad, bucket_pad)


@pytest.mark.parametrize(
    "arch, mode, experts, message",
    [
        ("ffn", "sentences", 0, "model.arch='ffn' reads n-gram contexts"),
        ("lstm", "ngram", 0, "data.mode='ngram' feeds the feed-forward LM only"),
        ("transformer", "sentences", 4, "padded positions would be routed to experts"),
    ],
)
def test_model_and_data_that_do_not_go_together_are_refused(arch, mode, experts, message):
    with pytest.raises(ValueError, match=message):
        check_model_and_data(arch, mode, experts)
    check_model_and_data("lstm", "sentences", 0)
    check_model_and_data("transformer", "stream", 4)
