"""The mixture-of-experts feed-forward layer, local or expert-parallel.

Pure PyTorch, no Lightning. :class:`MoELayer` replaces a Transformer block's FFN: a router (run in
float32) picks experts per token (:mod:`.gating`), the tokens are grouped by expert, every expert
is a GELU FFN, and the outputs are combined with the gate weights. Optionally a shared expert, a
plain FFN every token goes through, is added to the routed output (DeepSeekMoE, Dai et al. 2024,
arXiv:2401.06066); with narrow routed experts and ``top_k > 1`` that gives DeepSeekMoE's
fine-grained experts at the active size of a dense FFN: ``shared_dim + top_k * ffn_dim`` hidden
units per token.

Expert parallelism: :meth:`MoELayer.shard` keeps only this rank's ``num_experts / ep`` experts and
attaches the expert-parallel communicator. Tokens then travel to the rank holding their expert and
back with two all-to-alls (uneven splits, tag ``"tokens"``; the per-expert counts that precede
them are tagged ``"tokens_meta"``), and backward runs the transposed all-to-alls, so gradients
flow to the right tokens and experts.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_commstrats.comm import Communicator
from lightning_commstrats.moe.gating import BALANCE_MODES, Routing, balancing_bias, route
from lightning_commstrats.roles import declare

BIAS_UPDATE_RULES = ("sign", "quantile")
DEFAULT_BIAS_UPDATE_RATES = {"sign": 1e-3, "quantile": 1.0}
# "quantile": the gain grows by GAIN_UP when two updates in a row move the bias the same way, shrinks
# by GAIN_DOWN when they turn back, between GAIN_FLOOR x the rate and the rate (Kesten's rule)
GAIN_UP, GAIN_DOWN, GAIN_FLOOR = 1.25, 0.8, 0.05


class AllToAll(torch.autograd.Function):
    """All-to-all along dim 0 whose backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: Communicator, send: list[int], recv: list[int], tag: str) -> Tensor:  # type: ignore[override]
        ctx.comm, ctx.send, ctx.recv, ctx.tag = comm, send, recv, tag
        return comm.all_to_all(x.contiguous(), send, recv, tag=tag)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None, None]:  # type: ignore[override]
        return ctx.comm.all_to_all(grad.contiguous(), ctx.recv, ctx.send, tag=ctx.tag), None, None, None, None


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: ``grouped_mm``'s backward refuses the
    expanded (stride 0) gradient that, for one, ``out.sum().backward()`` produces."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad.contiguous()


GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's where it is on, else ``x``'s."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def grouped_mm_fits(x: Tensor, weight: Tensor) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` runs the experts of ``x`` (rows of ``d`` values)
    with weights like ``weight`` (``[experts, d, f]``) here, with autograd.

    torch 2.13 has a CPU grouped GEMM for float32, bfloat16 and float16 whose rows (``d`` and ``f``
    values) are multiples of 16 bytes. It is not an autocast op: under autocast the experts cast to
    autocast's dtype themselves. On CUDA it takes bfloat16 on SM 8.0+ only, which no test here can
    run, so CUDA takes the padded ``bmm``.
    """
    dtype = compute_dtype(x)
    size = torch.empty((), dtype=dtype).element_size()
    return (
        x.device.type == "cpu"
        and dtype in GROUPED_MM_DTYPES
        and weight.dtype in GROUPED_MM_DTYPES
        and x.shape[-1] * size % 16 == 0
        and weight.shape[-1] * size % 16 == 0
    )


class Experts(nn.Module):
    """``num_experts`` GELU FFNs ``d -> f -> d`` stored as stacked tensors (easy to shard).

    Forward runs all experts at once, two batched matmuls whatever the number of experts:

    - torch's grouped GEMM (``torch.nn.functional.grouped_mm``: every expert's rows, however many,
      against its own weight, one call) where it runs (:func:`grouped_mm_fits`: on CPU);
    - elsewhere (CUDA, rows that are no multiple of 16 bytes) one ``baddbmm`` on
      ``[experts, max rows, d]``: each expert's rows padded with zeros to the busiest expert's
      count. The padding is computed and thrown away:
      the work is ``experts x max rows`` instead of the rows, as cheap as the loop it replaces when
      the load is even (SWIPE, bias balancing), up to ``max / mean`` load times dearer when it is not.
    """

    def __init__(self, num_experts: int, d_model: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_experts, d_model, ffn_dim) * 0.02)
        self.b1 = nn.Parameter(torch.zeros(num_experts, ffn_dim))
        self.w2 = nn.Parameter(torch.randn(num_experts, ffn_dim, d_model) * 0.02)
        self.b2 = nn.Parameter(torch.zeros(num_experts, d_model))
        self.first = 0  # global index of the first expert held here

    def reset_parameters(self) -> None:
        """The draws of ``__init__`` (normal, std 0.02; zero biases) for the experts held here."""
        with torch.no_grad():
            for w in (self.w1, self.w2):
                w.normal_(0.0, 0.02)
            for b in (self.b1, self.b2):
                b.zero_()

    @property
    def count(self) -> int:
        return self.w1.shape[0]

    def keep(self, first: int, last: int) -> None:
        """Keep experts ``first .. last - 1`` only (their global indices)."""
        for name in ("w1", "b1", "w2", "b2"):
            setattr(
                self, name, nn.Parameter(getattr(self, name).detach()[first - self.first : last - self.first].clone())
            )
        self.first = first

    def forward(self, x: Tensor, counts: list[int]) -> Tensor:
        """``x``: rows grouped by local expert, ``counts[e]`` rows for expert ``e``."""
        # Every expert takes part in the batched matmuls, also one that no token came to: the result
        # must stay in the autograd graph even when no token came, or this rank would skip the
        # all-to-alls of backward that its peers wait in.
        sizes = torch.tensor(counts, dtype=torch.long, device=x.device)
        expert = torch.repeat_interleave(torch.arange(self.count, device=x.device), sizes, output_size=x.shape[0])
        if grouped_mm_fits(x, self.w1):
            dtype = compute_dtype(x)
            x, w1, b1, w2, b2 = (t.to(dtype) for t in (x, self.w1, self.b1, self.w2, self.b2))
            ends = sizes.cumsum(0).to(torch.int32)
            h = F.gelu(F.grouped_mm(x, w1, offs=ends) + b1[expert])
            return _DenseGrad.apply(F.grouped_mm(h, w2, offs=ends)) + b2[expert]
        rows = max(counts, default=0)
        # row i of expert e goes to padded row e * rows + (i - first row of e)
        first = sizes.cumsum(0) - sizes
        slot = (
            torch.arange(x.shape[0], device=x.device)
            + (torch.arange(self.count, device=x.device) * rows - first)[expert]
        )
        d = x.shape[-1]
        padded = x.new_zeros(self.count * rows, d).index_copy(0, slot, x).view(self.count, rows, d)
        h = F.gelu(torch.baddbmm(self.b1.unsqueeze(1), padded, self.w1))
        out = torch.baddbmm(self.b2.unsqueeze(1), h, self.w2)
        return out.view(self.count * rows, d)[slot]


class SharedExpert(nn.Module):
    """The GELU FFN ``d -> f -> d`` that every token goes through, initialised as the experts are."""

    def __init__(self, d_model: int, ffn_dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, ffn_dim)
        self.down = nn.Linear(ffn_dim, d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for linear in (self.up, self.down):
            nn.init.normal_(linear.weight, std=0.02)
            nn.init.zeros_(linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class MoELayer(nn.Module):
    """Top-k routed mixture of ``num_experts`` FFN experts.

    Args:
        d_model: token width.
        ffn_dim: every routed expert's hidden width.
        num_experts: experts in the layer (over all ranks).
        top_k: experts per token; 1 is Switch, more is GShard (weights renormalised to sum to 1).
        balance: ``"aux"`` (dropless), ``"capacity"`` (drop over capacity), ``"swipe"`` or
            ``"bias"`` (auxiliary-loss-free: a per-expert bias on the routing scores chooses the
            experts, see ``bias_update_rate``).
        capacity_factor: slots per expert relative to an even share (``"capacity"`` mode).
        shared_dim: hidden width of the shared expert (0: none, the default). It is a dense
            parameter like attention: replicated, never sharded.
        router_init_std: standard deviation of the router's normal initialisation (default 0.02,
            as every other Linear of the Transformer). Smaller starts the router closer to
            uniform; it must stay > 0 so that ties between experts are broken.
        bias_update_rate: ``balance="bias"`` only: how far every expert's bias moves per optimizer
            step. 0 freezes the bias (DeepSeek-V3's last 500B tokens). Default None: 1e-3 with
            ``bias_update_rule="sign"``, 1.0 with ``"quantile"``. With ``"sign"`` it is the step
            itself, 1e-3 being DeepSeek-V3's bias update speed (0.001 for its first 14.3T tokens,
            then 0; arXiv:2412.19437, section 4.2). The scores are softmax probabilities, about
            ``1 / num_experts`` each, so the rate is a step on that scale: too small and the bias
            needs many steps to cancel a router's preference (the load stays uneven meanwhile);
            too large and it overshoots, the overloaded expert changing from step to step (the
            sign rule never settles, it circles the balance within about one rate of bias). With
            ``"quantile"`` it is the largest share, in [0, 1], of the balancing change taken per
            update (the gain starts there and adapts below it).
            Tune it by the ``moe/balance`` log after warm-up.
        bias_update_rule: ``balance="bias"`` only: how the observed load sets the bias's step
            (:meth:`update_bias`), the load counted over all ranks since the last optimizer step.

            - ``"sign"`` (the default, DeepSeek-V3's and Wang et al.'s):
              ``bias_e += rate * sign(mean load - load_e)``, the same step however far off the
              load is and however sharp the router: its speed is fixed in units of score, so one
              rate is both too slow to undo a router that collapsed during the learning-rate
              warm-up (hundreds of steps at 1e-3) and too coarse near balance once larger.
            - ``"quantile"``: ``bias += gain * shift``, where ``shift`` is the change of the
              biases that would have brought every expert's load to the mean on the tokens since
              the last update, all experts together, scored by the router *after* the optimizer
              step: quantiles of those tokens' score margins
              (:func:`~lightning_commstrats.moe.gating.balancing_bias`), averaged over the ranks
              weighted by their tokens. A Newton step: its size follows how far off the load is
              and how sharp the router is, in units of score, so it is large while a router
              collapses and small near balance without a schedule; scoring with the stepped
              router removes the lag that the router's own step (large under Adam around the
              peak learning rate) gives a rule that looks at the load already routed. The gain
              follows Kesten's rule for stochastic approximation: it starts at the rate, grows
              by 1.25x (at most to the rate) when two updates in a row move the bias the same way
              (a lasting imbalance: too little correction) and shrinks by 0.8x (at least to 5% of
              the rate) when they turn back (chasing one batch's noise): near the learning-rate
              peak the router moves every step and the whole step is right; once it settles, a
              whole step only follows batch-to-batch noise. The gain and the last step are
              buffers (``bias_gain``, ``bias_last_step``), the same on every rank. The layer
              keeps the router inputs of the training forwards since the last update
              (``tokens x d_model`` float32 each) until then, and :func:`update_expert_biases`
              all-reduces ``[layers, 2, experts]`` float64 instead of the int64 counts.
              Measured on the Brown MoE recipe in ``benchmarks/results/moe/balance.md``.

    After a forward, ``aux_loss`` holds the load-balancing loss and ``routing`` the last
    :class:`~lightning_commstrats.moe.gating.Routing` (for metrics). With ``balance="bias"`` the
    bias is the buffer ``expert_bias`` (saved in checkpoints, the same on every rank), and the
    load of the training forwards since the last update accumulates until :meth:`update_bias`.
    """

    # buffers every rank computes alike by construction: strategies leave them out of the buffer
    # averaging, which could only round them (the mean of N equal floats is not always that float)
    agreed_buffers: tuple[str, ...] = ("expert_bias", "bias_gain", "bias_last_step")

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        num_experts: int,
        top_k: int = 1,
        balance: str = "aux",
        capacity_factor: float = 1.25,
        shared_dim: int = 0,
        router_init_std: float = 0.02,
        bias_update_rate: float | None = None,
        bias_update_rule: str = "sign",
    ) -> None:
        super().__init__()
        if ffn_dim < 1:
            raise ValueError(f"ffn_dim (the routed experts' width) must be >= 1, got {ffn_dim}")
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        if balance not in BALANCE_MODES:
            raise ValueError(f"balance={balance!r} is not supported; choose one of {BALANCE_MODES}")
        if balance == "swipe" and top_k != 1:
            raise ValueError("balance='swipe' routes top-1: set top_k=1")
        if not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
        if shared_dim < 0:
            raise ValueError(f"shared_dim must be >= 0, got {shared_dim}")
        if not router_init_std > 0:
            raise ValueError(
                f"router_init_std must be > 0 (ties between experts are broken at random), got {router_init_std}"
            )
        if bias_update_rule not in BIAS_UPDATE_RULES:
            raise ValueError(
                f"bias_update_rule={bias_update_rule!r} is not supported; choose one of {BIAS_UPDATE_RULES}"
            )
        if bias_update_rate is None:
            bias_update_rate = DEFAULT_BIAS_UPDATE_RATES[bias_update_rule]
        if (
            isinstance(bias_update_rate, bool)
            or not isinstance(bias_update_rate, (int, float))
            or not 0 <= bias_update_rate < math.inf
        ):
            raise ValueError(f"bias_update_rate must be a finite number >= 0, got {bias_update_rate!r}")
        if bias_update_rule == "quantile" and bias_update_rate > 1:
            raise ValueError(
                "bias_update_rate must be in [0, 1] with bias_update_rule='quantile' (the largest share"
                f" of the balancing change taken per update), got {bias_update_rate!r}"
            )
        self.num_experts = num_experts
        self.top_k = top_k
        self.balance = balance
        self.capacity_factor = capacity_factor
        self.router = declare(nn.Linear(d_model, num_experts, bias=False), "router")
        self.router_init_std = router_init_std
        nn.init.normal_(self.router.weight, std=router_init_std)
        self.experts = declare(Experts(num_experts, d_model, ffn_dim), "expert")
        self.shared = declare(SharedExpert(d_model, shared_dim), "ffn") if shared_dim else None
        self.active_dim = shared_dim + top_k * ffn_dim  # hidden units one token goes through
        self.comm: Communicator | None = None
        # the dtype tokens travel in to the experts and back (None: as they come); a precision
        # policy sets it to the experts' compute dtype: half experts, half the all-to-all bytes
        self.dispatch_dtype: torch.dtype | None = None
        self.aux_loss = torch.zeros(())
        self.routing: Routing | None = None
        self.bias_update_rate = float(bias_update_rate)
        self.bias_update_rule = bias_update_rule
        if balance == "bias":
            self.register_buffer("expert_bias", torch.zeros(num_experts))
            if bias_update_rule == "quantile":
                self.register_buffer("bias_gain", torch.tensor(self.bias_update_rate))
                self.register_buffer("bias_last_step", torch.zeros(num_experts))
        self._load_since_update: Tensor | None = None
        self._tokens_since_update: list[Tensor] = []  # "quantile": the router inputs, scored at the update

    def reset_parameters(self) -> None:
        """The router's draw of ``__init__`` (its experts and shared expert reset themselves); the
        buffers of ``balance="bias"`` are built for real even when the parameters are built empty."""
        nn.init.normal_(self.router.weight, std=self.router_init_std)

    def shard(self, comm: Communicator) -> None:
        """Keep this rank's share of the experts; tokens will travel over ``comm`` (the EP group)."""
        ep = comm.world_size
        if self.num_experts % ep:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by the expert-parallel size {ep}")
        per_rank = self.num_experts // ep
        self.experts.keep(comm.rank * per_rank, (comm.rank + 1) * per_rank)
        self.comm = comm

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        with torch.autocast(device_type=tokens.device.type, enabled=False):
            if self.router.weight.dtype == torch.float32:
                # through the router module: a router that is a unit of FSDP2 of its own (float32
                # inside a half block) is gathered by its own forward hook
                logits = self.router(tokens.float())
            else:  # a half router (precision O3): its weights brought up to float32 for the routing
                logits = F.linear(tokens.float(), self.router.weight.float())
        bias = self.expert_bias if self.balance == "bias" else None
        routing = route(logits, self.top_k, self.balance, self.capacity_factor, bias)
        self.aux_loss, self.routing = routing.aux_loss, routing
        if bias is not None and self.training:
            self._load_since_update = routing.load + (0 if self._load_since_update is None else self._load_since_update)
            if self.bias_update_rule == "quantile":
                self._tokens_since_update.append(tokens.detach().float())
        keep = routing.kept.reshape(-1)
        slot_expert = routing.experts.reshape(-1)[keep]
        slot_token = torch.arange(tokens.shape[0], device=x.device).repeat_interleave(self.top_k)[keep]
        slot_weight = routing.weights.reshape(-1)[keep]
        order = torch.argsort(slot_expert, stable=True)
        slot_expert, slot_token, slot_weight = slot_expert[order], slot_token[order], slot_weight[order]
        inputs = tokens[slot_token]
        if self.dispatch_dtype is not None:
            inputs = inputs.to(self.dispatch_dtype)
        counts = torch.bincount(slot_expert, minlength=self.num_experts)
        if self.comm is None or self.comm.world_size == 1:
            out = self.experts(inputs, counts.tolist())
        else:
            out = self._expert_parallel(inputs, counts)
        # experts may compute in another dtype than the layer's input (a precision policy): combine in the input's
        out = out.to(tokens.dtype) * slot_weight.unsqueeze(1).to(tokens.dtype)
        y = torch.zeros_like(tokens).index_add(0, slot_token, out)
        if self.shared is not None:
            y = y + self.shared(tokens)
        return y.view(shape)

    def load_since_update(self) -> Tensor:
        """``[num_experts]`` slots this rank routed to every expert in training forwards since the
        last :meth:`update_bias` (int64; zeros when none ran)."""
        if self._load_since_update is None:
            return torch.zeros(self.num_experts, dtype=torch.long, device=self.router.weight.device)
        return self._load_since_update

    def shift_since_update(self) -> Tensor:
        """``[num_experts]`` float32, ``bias_update_rule="quantile"``: over the training forwards
        since the last :meth:`update_bias`, the sum of tokens times the balancing change of the
        biases (:func:`~lightning_commstrats.moe.gating.balancing_bias`), their router inputs
        scored by the router and bias as they are now (call it after the optimizer step; zeros
        when no forward ran)."""
        shift = torch.zeros(self.num_experts, device=self.router.weight.device)
        with torch.no_grad():
            for tokens in self._tokens_since_update:
                probs = F.softmax(F.linear(tokens, self.router.weight.float()), dim=-1)
                shift = shift + balancing_bias(probs, self.expert_bias, self.top_k) * tokens.shape[0]
        return shift

    @torch.no_grad()
    def update_bias(self, load: Tensor | None = None, shift: Tensor | None = None) -> None:
        """``balance="bias"``: move every expert's bias towards balance and start counting the load
        afresh: ``bias_e += rate * sign(mean(load) - load_e)`` (``bias_update_rule="sign"``) or
        ``bias += gain * shift / tokens`` (``"quantile"``: ``shift`` as :meth:`shift_since_update`,
        summed over the ranks as ``load`` is, ``tokens = sum(load) / top_k``; no step when none;
        the gain adapted first, see the class's ``bias_update_rule``).

        Call it once per optimizer step, after the step, on every rank with the same ``load`` (and
        ``shift``): the slots routed to every expert since the last update summed over all ranks
        (the default, this rank's :meth:`load_since_update` and :meth:`shift_since_update`, is right
        on one process only). :func:`update_expert_biases`
        does it for every such layer of a model with one all-reduce.
        """
        if self.balance != "bias":
            raise ValueError(f"update_bias needs balance='bias', this layer has balance={self.balance!r}")
        load = (self.load_since_update() if load is None else load).to(self.expert_bias.device, torch.float32)
        if self.bias_update_rule == "quantile":
            shift = (self.shift_since_update() if shift is None else shift).to(self.expert_bias.device, torch.float32)
            tokens = load.sum() / self.top_k
            step = shift / tokens.clamp(min=1)  # no tokens: no shift, a zero step, the gain kept
            agree = (step * self.bias_last_step).sum()
            factor = torch.where(agree > 0, GAIN_UP, torch.where(agree < 0, GAIN_DOWN, 1.0))
            gain = (self.bias_gain * factor).clamp(GAIN_FLOOR * self.bias_update_rate, self.bias_update_rate)
            self.bias_gain.copy_(gain)
            self.expert_bias.add_(self.bias_gain * step)
            self.bias_last_step.copy_(step)
        else:
            self.expert_bias.add_(torch.sign(load.mean() - load), alpha=self.bias_update_rate)
        self._load_since_update = None
        self._tokens_since_update = []

    def _expert_parallel(self, inputs: Tensor, counts: Tensor) -> Tensor:
        comm = self.comm
        ep, local = comm.world_size, self.experts.count
        per_rank = counts.view(ep, local)
        send = per_rank.sum(1).tolist()
        # how many rows each source rank sends for each of my experts: [source, local expert]
        recv_counts = comm.all_to_all(per_rank, [1] * ep, [1] * ep, tag="tokens_meta")
        recv = recv_counts.sum(1).tolist()
        received = AllToAll.apply(inputs, comm, send, recv, "tokens")
        # received rows are grouped by source, then expert: regroup by expert for the FFNs
        source_major = torch.arange(ep * local, device=inputs.device).view(ep, local)
        chunk_ids = torch.repeat_interleave(source_major.reshape(-1), recv_counts.reshape(-1))
        by_expert = torch.argsort(chunk_ids % local * ep + chunk_ids // local, stable=True)
        computed = self.experts(received[by_expert], recv_counts.sum(0).tolist())
        back = torch.empty_like(by_expert)
        back[by_expert] = torch.arange(by_expert.numel(), device=inputs.device)
        return AllToAll.apply(computed[back], comm, recv, send, "tokens")


def update_expert_biases(model: nn.Module, sum_over_ranks: Callable[[Tensor], Tensor] | None = None) -> None:
    """After an optimizer step: update the bias of every ``balance="bias"`` layer of ``model`` from
    the load of all ranks (:meth:`MoELayer.update_bias`).

    The layers' counts since the last update, ``[layers, experts]`` int64, are summed over the ranks
    by ``sum_over_ranks`` (one collective for all layers; None on one process), so every rank applies
    the same update. With a ``bias_update_rule="quantile"`` layer the collective carries the counts
    and the shifts (:meth:`MoELayer.shift_since_update`) together, ``[layers, 2, experts]`` float64.
    :class:`~lightning_commstrats.models.LanguageModel` calls it after every optimizer step; in a loop
    of one's own (Fabric), after ``optimizer.step()``::

        update_expert_biases(model, lambda t: fabric.all_reduce(t, reduce_op="sum"))
    """
    layers = [m for m in model.modules() if isinstance(m, MoELayer) and m.balance == "bias"]
    if not layers:
        return
    load = torch.stack([m.load_since_update() for m in layers])
    if any(m.bias_update_rule == "quantile" for m in layers):
        # the shifts travel with the counts, in float64 (exact for counts below 2**53)
        both = torch.stack([load.double(), torch.stack([m.shift_since_update() for m in layers]).double()], 1)
        if sum_over_ranks is not None:
            both = sum_over_ranks(both)
        for layer, (counts, shift) in zip(layers, both, strict=True):
            layer.update_bias(counts, shift)
        return
    if sum_over_ranks is not None:
        load = sum_over_ranks(load)
    for layer, counts in zip(layers, load, strict=True):
        layer.update_bias(counts)
