"""``onebit_sgd``: 1-bit SGD with error feedback (Seide et al., Interspeech 2014; CNTK's DataParallelSGD)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_commstrats.buckets import DEFAULT_BUCKET_CAP_MB
from lightning_commstrats.compression.exchange import GradientCompression
from lightning_commstrats.strategies.allreduce import AllReduceStrategy, trainable_params
from lightning_commstrats.strategies.base import DEFAULT_TIMEOUT


class OneBitSGDStrategy(AllReduceStrategy):
    """Data parallelism whose gradients travel quantized to 1 (or n) bits per value, with error feedback.

    Stores, per rank, the quantization residuals of both aggregation stages (keyed by parameter
    name, saved in checkpoints for every rank), and the sample and step counters of the warm start.

    Each step, for every gradient matrix (a parameter with 2+ dimensions and more than
    ``small_tensor_numel`` values, viewed as ``[shape[0], rest]``):

    1. add this rank's residual to the gradient; quantize every column: 1 bit per value (its sign)
       and two floats per column (the mean of its non-negative and of its negative entries), or n
       bits on a uniform grid; keep what quantization lost as the new residual (error feedback: the
       loss is sent later, nothing is dropped);
    2. the columns are cut into one stripe per rank; each rank sends every other rank its quantized
       copy of that rank's stripe (all-to-all of packed bytes);
    3. each owner sums the N decoded copies of its stripe, adds its own second residual, quantizes
       the sum again and keeps the second residual;
    4. the quantized sums are all-gathered; every rank decodes the same bytes, so all ranks hold
       bit-identical averaged gradients; the optimizer then steps as usual.

    Biases, norms and other small tensors go in full precision in one fused all-reduce.

    Hyperparameters:

    - ``num_quantization_bits``: 1 sends 1/32 of the fp32 gradient (plus two floats per column
      and stripe). Quantization noise is fed back, so 1 bit converges close to full precision on
      the models the paper measured (speech DNNs), but early training, when gradients are large
      and change fast, suffers most: use the warm start. 2, 4 and 8 bits trade bytes for less
      noise; 16 sends float16 (or bfloat16) values; 32 is plain data-parallel SGD (``allreduce``).
    - ``distributed_after``: exchange in full precision until this many samples (over all ranks,
      as CNTK counts ``distributedAfterSampleCount``) or optimizer steps have been trained, then
      quantize. The paper starts from a model trained for a while without quantization; a few
      thousand samples or the first epoch's first percent are typical. Too small: early noise
      hurts final accuracy; too large: bytes are spent where they were not needed.
    - ``small_tensor_numel``: tensors with at most this many values, and all one-dimensional
      ones, are not worth quantizing (CNTK: 1024); they are few bytes and sensitive (biases, norms).

    Optimizer: 1-bit SGD was designed for SGD. Per-coordinate adaptive optimizers (Adam) rescale
    the quantization noise coordinate by coordinate: on this package's Brown LSTM benchmark 1 bit
    matched ``allreduce`` within 0.3% perplexity with SGD but lost 18% with Adam, whatever the warm
    start (``benchmarks/results/onebit_quality``), and at its defaults (no warm start) ended 37%
    worse than one rank training alone (``benchmarks/results/adam_defaults``). It warns at the start
    of a fit under Adam or AdamW below 16 bits; ``onebit_adam`` and ``zero_one_adam`` keep Adam and
    compress its momentum instead.

    Tuning: measure the validation loss of a short run against ``allreduce``; if 1 bit lags,
    raise ``distributed_after`` first, then ``num_quantization_bits``. With small minibatches per
    rank the gradient per column is noisy and the two means carry little: 1-bit SGD pays off with
    large minibatches (the paper used 1024 to 8192 frames) and large matrices.

    Reference: F. Seide, H. Fu, J. Droppo, G. Li, D. Yu, "1-Bit Stochastic Gradient Descent and its
    Application to Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014.

    Args:
        num_quantization_bits: 1, 2, 4, 8, 16 or 32.
        distributed_after: full-precision exchange before this many ``distributed_after_unit``.
        distributed_after_unit: ``"samples"`` (over all ranks, CNTK's unit) or ``"steps"``
            (optimizer steps).
        small_tensor_numel: tensors this small (or 1-D) are all-reduced in fp32.
        half_dtype: the 16-bit format, ``"float16"`` or ``"bfloat16"``.
        residuals: where the error-feedback residuals (both stages', and with ``slow_hop_bits`` the slow
            hop's) wait between steps: ``"device"`` (default) or ``"host"``: on CUDA in pinned host
            memory, each brought to the device for its gradient's encoding and written back after it,
            both copies queued on the stream without the host waiting
            (:class:`~lightning_commstrats.buckets.Parking`). Host residuals free device memory the
            size of the quantized gradients (and their stripe) for two copies of it over the host link
            every step; the results are bit for bit those of ``"device"``. On CPU the two are the same memory.
        bucket_cap_mb, backend, timeout, start_method: as :class:`AllReduceStrategy`.
        **kwargs: as :class:`AllReduceStrategy` (``resume_mismatch="reset"`` restarts the residuals
            when a checkpoint's do not fit).

    Example::

        import lightning as L
        import lightning_commstrats

        strategy = lightning_commstrats.OneBitSGDStrategy(num_quantization_bits=1, distributed_after=64_000)
        trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy)
    """

    strategy_name = "onebit_sgd"

    def __init__(
        self,
        num_quantization_bits: int = 1,
        distributed_after: int = 0,
        distributed_after_unit: str = "samples",
        small_tensor_numel: int = 1024,
        half_dtype: str = "float16",
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        backend: str = "auto",
        timeout: timedelta = DEFAULT_TIMEOUT,
        start_method: str = "popen",
        residuals: str = "device",
        **kwargs: Any,
    ) -> None:
        compression = GradientCompression(
            num_quantization_bits,
            distributed_after,
            distributed_after_unit,
            small_tensor_numel,
            half_dtype,
            residuals=residuals,
        )
        super().__init__(
            bucket_cap_mb=bucket_cap_mb,
            backend=backend,
            timeout=timeout,
            start_method=start_method,
            residuals=residuals,  # the slow hop's (the reducer's, connected at setup)
            **kwargs,
        )
        self.compression = compression

    @property
    def num_quantization_bits(self) -> int:
        return self.compression.bits

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        adam = [type(o).__name__ for o in self.optimizers if isinstance(o, (torch.optim.Adam, torch.optim.AdamW))]
        if adam and self.compression.bits < 16:
            rank_zero_warn(
                f"onebit_sgd quantizes the gradients that {adam[0]} then rescales value by value; on this package's"
                " LSTM recipe 1 bit with Adam ended 18.5% above allreduce in perplexity"
                " (benchmarks/results/onebit_quality). strategy='onebit_adam' (or 'zero_one_adam') keeps Adam and"
                " compresses its momentum instead, within 1% of allreduce on the same run."
            )

    @override
    def after_backward(self, optimizer: Optimizer) -> None:
        if self.world_size > 1:
            self.exchange_compressed(self.compression, trainable_params(optimizer))

    # ------------------------------------------------------------------ checkpointed state

    @override
    def rank_state_dict(self) -> dict[str, Any]:
        return self.compression.state_dict()

    @override
    def load_state_dict(self, state: dict[str, Any], rank_state: dict[str, Any]) -> None:
        self.check_compression_state(self.compression, rank_state)
        super().load_state_dict(state, rank_state)
        self.bind_compression(self.compression).load_state_dict(rank_state)

    @override
    def reset_state(self) -> None:
        if self.compression.exchange is not None:
            self.compression.exchange.reset()
