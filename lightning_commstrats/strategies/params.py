"""The parameters a strategy exchanges: by fully qualified name, and what each one is on this rank.

A strategy keys all per-parameter state (residuals, buckets, checkpoints) by the parameter's name in
the LightningModule, and it must know whether the tensor it reads is the whole parameter, this rank's
FSDP2 shard, or an expert this rank owns. :class:`ParamSet` is that record, built once the model is
final (after sharding; the strategy builds it anew when a parameter it is asked about is not in it,
as after a module's parameters were replaced), so a name is one dictionary lookup on the hot path.

FSDP2 registers the gathered, unsharded tensors in place of the shards between a forward and its
backward, and keeps them after a forward without backward (validation) for a module that does not
reshard after forward (the root under FSDP2's default, every module with
``reshard_after_forward=False``). The set holds the shards' own parameter objects, so what it reads
is always the shards; :meth:`ParamSet.local_tensors` also reshards first, so that what a strategy
writes into them (a global model) is what the next forward gathers, not a stale gathered copy.
No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch import Tensor, nn

from lightning_commstrats.sharding import local
from lightning_commstrats.sharding.layout import is_dtensor

WHOLE = "whole"  # every replica holds it whole
SHARD = "shard"  # an FSDP2 DTensor: this rank holds one shard
EXPERT = "expert"  # an MoE expert this rank owns (expert parallelism)
KINDS = (WHOLE, SHARD, EXPERT)


class ParamSet:
    """The parameters of ``module`` by name (tied parameters once, under their first name), each with
    its kind (:data:`WHOLE`, :data:`SHARD` or :data:`EXPERT`).

    Args:
        module: the LightningModule (or model) as set up: sharded, on its device.
        expert: says which parameters are experts (``(name, parameter) -> bool``); none by default.
    """

    def __init__(self, module: nn.Module, expert: Callable[[str, nn.Parameter], bool] | None = None) -> None:
        self.module = module
        named = list(module.named_parameters())
        self.names: list[str] = [n for n, _ in named]
        self.params: list[nn.Parameter] = [p for _, p in named]
        self._by_name = dict(named)
        self._by_id = {id(p): n for n, p in named}
        self.kinds: dict[str, str] = {
            n: EXPERT if expert is not None and expert(n, p) else SHARD if is_dtensor(p) else WHOLE for n, p in named
        }

    def __repr__(self) -> str:
        counts = {k: sum(1 for v in self.kinds.values() if v == k) for k in KINDS}
        return f"ParamSet({', '.join(f'{c} {k}' for k, c in counts.items() if c)})"

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __getitem__(self, name: str) -> nn.Parameter:
        return self._by_name[name]

    def name_of(self, p: Tensor) -> str | None:
        """The name of parameter ``p`` (the object itself, not an equal tensor), or ``None``."""
        return self._by_id.get(id(p))

    @property
    def sharded(self) -> bool:
        """Whether any parameter is an FSDP2 shard."""
        return SHARD in self.kinds.values()

    def reshard(self) -> None:
        """Put every FSDP2 module of the model back on its shards (FSDP2's ``FSDPModule.reshard``), so
        that the registered parameters are the shards again; a no-op when nothing is sharded."""
        if not self.sharded:
            return
        from torch.distributed.fsdp import FSDPModule

        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def local_tensors(self, kinds: tuple[str, ...] = KINDS) -> dict[str, Tensor]:
        """This rank's tensor of every parameter of ``kinds`` by name (the shard of a sharded one),
        resharded first: writes into them reach the next forward."""
        self.reshard()
        return {n: local(self._by_name[n]) for n in self.names if self.kinds[n] in kinds}
