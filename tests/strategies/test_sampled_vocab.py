"""`sampled_vocab` set-up errors, in one process."""

import lightning as L
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_commstrats import SampledVocabStrategy
from lightning_commstrats.models import LanguageModel


def _fit(model, strategy):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    return trainer


class TinyLM(LanguageModel):
    def __init__(self):
        super().__init__(vocab_size=20, embed_dim=4, hidden_dim=4)

    def train_dataloader(self):
        import torch
        from torch.utils.data import DataLoader

        from lightning_commstrats.data import StreamWindows

        return DataLoader(StreamWindows(torch.arange(40) % 20, 5, pad_id=2), batch_size=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"alpha": -1}, r"alpha must be a count >= 0 \(an int\) or a fraction in"),
        ({"beta": -0.5}, r"beta must be a count >= 0 \(an int\) or a fraction in"),
        ({"alpha": "all"}, "alpha must be a count"),
    ],
)
def test_bad_sizes_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SampledVocabStrategy(**kwargs)


def test_sizes_larger_than_the_vocabulary_fail_at_setup():
    with pytest.raises(ValueError, match="alpha=21 must be between 0 and the vocabulary size 20"):
        _fit(TinyLM(), SampledVocabStrategy(alpha=21, beta=0, word_counts=[1] * 20))
    with pytest.raises(ValueError, match="beta=50 must be between 0 and the vocabulary size 20"):
        _fit(TinyLM(), SampledVocabStrategy(alpha=0, beta=50))


def test_model_without_vocabulary_and_unknown_names():
    with pytest.raises(ValueError, match=r"declares no vocabulary parameters .* pass vocab_params"):
        _fit(BoringModel(), SampledVocabStrategy(alpha=0))
    with pytest.raises(ValueError, match=r"vocab_params names \['nope.weight'\], which the model does not have"):
        _fit(BoringModel(), SampledVocabStrategy(alpha=0, vocab_params=["nope.weight"]))


def test_alpha_needs_frequencies_and_names_work():
    with pytest.raises(ValueError, match="alpha > 0 needs word frequencies"):
        _fit(TinyLM(), SampledVocabStrategy(alpha=5, beta=0))
    trainer = _fit(BoringModel(), SampledVocabStrategy(alpha=0, beta=1, vocab_params=["layer.weight"]))
    assert trainer.strategy._vocab_size == 2
    trainer = _fit(TinyLM(), SampledVocabStrategy(alpha=0.5, beta=0, word_counts=list(range(20))))
    assert trainer.strategy._alpha_ids.tolist() == list(range(10, 20))
