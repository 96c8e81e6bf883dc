"""``sampled_vocab``: exchange only sampled rows of the vocabulary matrices (the 2018 multi-GPU NLM paper)."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_commstrats.compression import most_frequent, random_rows, resolve_count
from lightning_commstrats.compression.exchange import GradientCompression
from lightning_commstrats.models.base import declared_vocabulary
from lightning_commstrats.sharding import tensors_in
from lightning_commstrats.strategies.allreduce import AllReduceStrategy, dense_grad, trainable_params
from lightning_commstrats.strategies.base import DEFAULT_TIMEOUT

log = logging.getLogger(__name__)


class SampledVocabStrategy(AllReduceStrategy):
    """Data parallelism in which the vocabulary matrices exchange only the rows of sampled words.

    Stores the frequent-word set, the sampling seed, and with error feedback every rank's unsent
    rows (checkpointed per rank); the last step's selection is ``last_rows``.

    A step reads device memory on the host three times, for what only the data says: how many
    distinct words this rank saw, how many every rank saw (the lengths of the all-gather), and how
    many rows that makes.

    Every step, for the vocabulary matrices of a language model (input embedding, output
    projection and its bias; one matrix when tied):

    1. ``V_base``: each rank's minibatch word ids (every integer tensor of the batch: inputs and
       targets) are all-gathered and merged (tag ``"vocab_ids"``);
    2. ``V_alpha``: the ``alpha`` most frequent words of the corpus, fixed for the run;
    3. ``V_beta``: ``beta`` random words from a generator seeded identically on every rank for the
       step, so the ranks agree without communicating;
    4. the rows ``V_all = V_base U V_alpha U V_beta`` of every vocabulary matrix are packed into one
       dense buffer and all-reduced (tag ``"vocab_rows"``); every other row gets a zero gradient
       and is restored after the optimizer step, so it is not updated on any rank (ranks never
       diverge, whatever the optimizer's momentum or weight decay).

    The input embedding's gradient is zero outside the minibatch words, so that part is exact; the
    output layer's softmax gradient touches every row, and the unselected rows' share is dropped
    (or, with ``error_feedback``, kept locally and sent when the row is next selected). All other
    parameters are exchanged by the strategy's :class:`~lightning_commstrats.compression.GradientCompression`:
    fp32 all-reduce (``num_quantization_bits=32``, the default) or 1-bit SGD
    (``num_quantization_bits=1`` and the other ``onebit_sgd`` knobs).

    Hyperparameters:

    - ``alpha``: the most frequent words always exchanged, as a count or a fraction of the
      vocabulary. Frequent words appear in most minibatches anyway; alpha guarantees their softmax
      rows keep up. Larger: closer to full exchange, more bytes.
    - ``beta``: random words per step (count or fraction), so that every row is refreshed now and
      then (the paper's "robustness" term). 0 leaves rare words' output rows to their own
      occurrences.
    - ``error_feedback``: keep the unsent output-row gradients locally and add them when the row is
      next selected. Off by default, as in the paper: stale softmax gradients of rare words can
      overshoot when they finally go out; on, no gradient is lost.
    - ``vocab_params``: parameter names, when the model does not declare ``vocab_parameters()``.

    Optimizer: frozen rows also miss the momentum an adaptive optimizer would have applied to them.
    On this package's Brown LSTM benchmark (10k words) the perplexity came within 2.3% (0.4% with
    error feedback) of ``allreduce`` with SGD, but 12% (10%) behind with Adam
    (``benchmarks/results/sampled_vocab``).

    The gain grows with the vocabulary: the rows sent depend on the minibatch, not on ``V``, so a
    large vocabulary (the paper: about 49k words on Brown) saves most.

    Args:
        alpha: frequent words, count or fraction of the vocabulary (default 2000).
        beta: random words per step, count or fraction (default 1000).
        vocab_params: names of the vocabulary parameters; default: the model's declaration.
        error_feedback: accumulate unsent row gradients locally.
        word_counts: corpus frequency of each word id; default: the DataModule's ``word_counts``.
        seed: seed of the random rows (the same on every rank).
        num_quantization_bits: inner scheme for the other parameters: 32 (fp32 all-reduce) or 1, 2,
            4, 8, 16 (``onebit_sgd``).
        distributed_after, distributed_after_unit, small_tensor_numel, half_dtype: the warm start
            and codec of that exchange, as in :class:`OneBitSGDStrategy`.
        **kwargs: :class:`AllReduceStrategy` / :class:`CommStrategy` arguments.
    """

    strategy_name = "sampled_vocab"
    supports_shard = False

    def __init__(
        self,
        alpha: int | float = 2000,
        beta: int | float = 1000,
        vocab_params: list[str] | None = None,
        error_feedback: bool = False,
        word_counts: list[int] | None = None,
        seed: int = 0,
        num_quantization_bits: int = 32,
        distributed_after: int = 0,
        distributed_after_unit: str = "samples",
        small_tensor_numel: int = 1024,
        half_dtype: str = "float16",
        backend: str = "auto",
        timeout: timedelta = DEFAULT_TIMEOUT,
        start_method: str = "popen",
        **kwargs: Any,
    ) -> None:
        for name, value in (("alpha", alpha), ("beta", beta)):
            bad_type = isinstance(value, bool) or not isinstance(value, (int, float))
            if bad_type or value < 0 or (isinstance(value, float) and value > 1):
                raise ValueError(
                    f"{name} must be a count >= 0 (an int) or a fraction in [0, 1] (a float), got {value!r}"
                )
        gradient_compression = GradientCompression(
            num_quantization_bits,
            distributed_after,
            distributed_after_unit,
            small_tensor_numel,
            half_dtype,
            residuals=kwargs.get("residuals", "device"),  # the compressed exchange's, as the slow hop's
        )
        super().__init__(backend=backend, timeout=timeout, start_method=start_method, **kwargs)
        self.compression = gradient_compression
        self.alpha = alpha
        self.beta = beta
        self.vocab_param_names = vocab_params
        self.error_feedback = error_feedback
        self.word_counts = word_counts
        self.seed = seed
        self._last_rows: Tensor | None = None
        self._vocab: list[torch.nn.Parameter] = []
        self._vocab_size = 0
        self._beta = 0
        self._alpha_ids: Tensor | None = None
        self._seen: Tensor | None = None  # [V + 1] booleans: the words of this step's minibatches (V: none)
        self._residuals: dict[str, Tensor] = {}
        self._frozen: list[tuple[torch.nn.Parameter, Tensor, Tensor]] = []

    # ------------------------------------------------------------------ set-up

    @override
    def setup_scheme(self) -> None:
        super().setup_scheme()
        self._find_vocabulary()

    def _find_vocabulary(self) -> None:
        module = self.lightning_module
        named = dict(module.named_parameters())
        if self.vocab_param_names is not None:
            missing = [n for n in self.vocab_param_names if n not in named]
            if missing:
                raise ValueError(f"vocab_params names {missing}, which the model does not have; it has {list(named)}")
            params = [named[n] for n in self.vocab_param_names]
        else:
            params = declared_vocabulary(module)
            if not params:
                raise ValueError(
                    "sampled_vocab: the model declares no vocabulary parameters (no vocab_parameters() method);"
                    " pass vocab_params=[<names>]"
                )
        unique = list({id(p): p for p in params}.values())
        sizes = {p.shape[0] for p in unique}
        if len(sizes) != 1:
            raise ValueError(f"vocabulary parameters must share their first dimension (V), got {sorted(sizes)}")
        self._vocab = unique
        self._vocab_size = v = sizes.pop()
        alpha = resolve_count(self.alpha, v, "alpha")
        self._beta = resolve_count(self.beta, v, "beta")
        counts = self.word_counts
        trainer = self.trainer
        if counts is None and trainer is not None and trainer.datamodule is not None:
            counts = getattr(trainer.datamodule, "word_counts", None)
        if alpha and counts is None:
            raise ValueError(
                "alpha > 0 needs word frequencies: pass word_counts=... or (with the Trainer) use a DataModule"
                " with word_counts"
            )
        counts_t = torch.as_tensor(counts if counts is not None else [0] * v, dtype=torch.float64)
        if counts_t.numel() != v:
            raise ValueError(f"word_counts has {counts_t.numel()} entries, the vocabulary {v}")
        self._alpha_ids = most_frequent(counts_t, alpha).to(self.root_device)

    # ------------------------------------------------------------------ the step

    @property
    def last_rows(self) -> Tensor | None:
        """The last step's ``V_all``: sorted word ids on the CPU (``None`` before the first step)."""
        return None if self._last_rows is None else self._last_rows.cpu()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._vocab_size and self.world_size > 1:
            self._mark_words(batch)

    def _mark_words(self, batch: Any) -> None:
        """Mark the word ids of every integer tensor of ``batch`` (those in ``[0, V)``; others, such as
        ignored targets, mark the extra entry ``V``): no shape depends on the data, so the host never
        waits for the device here."""
        v, seen = self._vocab_size, self._words_seen()

        def mark(t: Tensor) -> Tensor:
            if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
                ids = t.reshape(-1).to(seen.device, torch.int64)
                seen[torch.where((ids >= 0) & (ids < v), ids, v)] = True
            return t

        apply_to_collection(batch, Tensor, mark)

    def _words_seen(self) -> Tensor:
        if self._seen is None:
            self._seen = torch.zeros(self._vocab_size + 1, dtype=torch.bool, device=self.root_device)
        return self._seen

    @override
    def after_backward(self, optimizer: Optimizer) -> None:
        if self.world_size == 1:
            return
        params = trainable_params(optimizer)
        vocab_ids = {id(p) for p in self._vocab}
        self.exchange_compressed(self.compression, [p for p in params if id(p) not in vocab_ids])
        vocab = [p for p in params if id(p) in vocab_ids]
        if vocab:
            self._exchange_rows(vocab)

    def select_rows(self) -> Tensor:
        """This step's ``V_all``, sorted, identical on every rank (one all-gather of the word ids)."""
        return self._select()[0]

    def _select(self) -> tuple[Tensor, Tensor]:
        """``V_all`` (sorted ids) and the mask of the words it holds."""
        v, seen = self._vocab_size, self._words_seen()
        local = seen[:v].nonzero().squeeze(1)  # this rank's distinct words, ascending
        seen.zero_()
        parts = self.comm.all_gather_uneven(local.to(torch.int32), tag="vocab_ids")
        assert self._alpha_ids is not None
        chosen = torch.zeros(v, dtype=torch.bool, device=seen.device)
        chosen[self._alpha_ids] = True
        beta = random_rows(v, self._beta, self.seed, self.optimizer_steps)
        if chosen.device.type == "cuda":  # copied from pinned memory, the host does not wait for the device
            beta = beta.pin_memory()
        chosen[beta.to(chosen.device, non_blocking=True)] = True
        for part in parts:
            chosen[part.long()] = True
        return chosen.nonzero().squeeze(1), chosen

    def _exchange_rows(self, vocab: list[torch.nn.Parameter]) -> None:
        rows, chosen = self._select()
        self._last_rows = rows
        grads = [dense_grad(p) for p in vocab]
        if self.error_feedback:
            for p, g in zip(vocab, grads, strict=True):
                res = self._residuals.get(self.param_name(p))
                if res is not None:
                    g.add_(res)
        widths = [g[0].numel() for g in grads]
        # one more value: 0, or NaN when any of this rank's vocabulary gradients (rows exchanged or
        # not, which reach its residuals) is not finite; the average then tells every rank alike
        poison = (torch.stack(torch._foreach_norm(grads)).sum() * 0).float().reshape(1)
        packed = torch.cat([g[rows].reshape(rows.numel(), -1).float() for g in grads], dim=1).reshape(-1)
        flat = self.comm.all_reduce(torch.cat([packed, poison]), "avg", tag="vocab_rows")
        if not bool(torch.isfinite(flat).all()):  # one host sync per step, the same on every rank
            self.report_nonfinite([self.param_name(p) for p in vocab])  # residuals and rows left as they were
            self._frozen = []
            return
        averaged = flat[:-1].view(rows.numel(), -1).split(widths, dim=1)
        # the rows not exchanged, which no rank updates: the host knows how many, so their ids
        # come without waiting for the device
        frozen = self._vocab_size - rows.numel()
        still = torch.nonzero_static(~chosen, size=frozen).squeeze(1) if frozen else None
        self._frozen = []
        for p, g, new in zip(vocab, grads, averaged, strict=True):
            if self.error_feedback:
                res = g.detach().clone()
                res[rows] = 0
                self._residuals[self.param_name(p)] = res
            g.zero_()
            g[rows] = new.reshape(-1, *g.shape[1:]).to(g.dtype)
            if still is not None:
                self._frozen.append((p, still, p.detach().index_select(0, still)))

    @override
    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        super().after_optimizer_step(optimizer)
        with torch.no_grad():
            for p, still, saved in self._frozen:
                p.index_copy_(0, still, saved)
        self._frozen = []

    # ------------------------------------------------------------------ checkpointed state

    @override
    def rank_state_dict(self) -> dict[str, Any]:
        return {**self.compression.state_dict(), "vocab_residuals": dict(self._residuals)}

    @override
    def load_state_dict(self, state: dict[str, Any], rank_state: dict[str, Any]) -> None:
        params = dict(self.lightning_module.named_parameters())
        for name, res in rank_state.get("vocab_residuals", {}).items():
            if name not in params or params[name].shape != res.shape:
                raise ValueError(f"its vocabulary residual {name!r} {tuple(res.shape)} does not fit this model")
        self.check_compression_state(self.compression, rank_state)
        super().load_state_dict(state, rank_state)
        self.bind_compression(self.compression).load_state_dict(rank_state)
        self._residuals = dict(rank_state.get("vocab_residuals", {}))

    @override
    def scheme_tensors(self) -> list[Tensor]:
        return super().scheme_tensors() + tensors_in([self._residuals, self._seen, self._alpha_ids, self._last_rows])

    @override
    def reset_state(self) -> None:
        if self.compression.exchange is not None:
            self.compression.exchange.reset()
        self._residuals = {}
