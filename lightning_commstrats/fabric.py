"""The package's schemes under Lightning Fabric: ``Fabric(strategy="bmuf")``.

Fabric's own ``DDPStrategy`` has no communication hooks and no periodic averaging. Importing the
package registers every scheme's name with Fabric's ``STRATEGY_REGISTRY`` as well as the Trainer's,
so the same names work in both::

    import lightning as L
    import lightning_commstrats

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="bmuf")
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    for batch in loader:
        loss = model(batch).mean()
        fabric.backward(loss)
        optimizer.step()  # the scheme exchanges here
        optimizer.zero_grad()
    fabric.strategy.finish()  # periodic schemes: the last sync, every rank holds the global model

Settings go to the scheme: ``FabricStrategy("bmuf", sync_period=8, sync_period_unit="steps")``, or
``FabricStrategy(BMUFStrategy(...))`` for an instance.

One scheme, two front ends: :class:`FabricStrategy` holds the very object the Trainer would use
(a :class:`~lightning_commstrats.strategies.CommStrategy`) and drives its hooks, so the exchange,
the communicator, the statistics and the checkpointed state are the same code; only the order of
calls comes from Fabric instead of the Trainer's loop:

- ``fabric.setup``: the model moves to its device, the scheme shards it (``expert_parallel``, or
  FSDP2 with ``shard="fsdp"``: then make the optimizer after ``fabric.setup_module``),
  every rank takes rank 0's weights, and the scheme builds its structures;
- the first forward in training mode starts the run (the periodic schemes take the global model);
  every forward in training mode counts the batch's samples (schedules in samples) and hands the
  batch to the scheme (``sampled_vocab`` reads its word ids);
- ``optimizer.step()``: the gradient exchange, the local step, then the weight exchange;
- ``fabric.save`` / ``fabric.load``: the model as the scheme saves it (the global model for the
  periodic schemes), the scheme's shared state in the file, each rank's own state in a shard
  beside it, as with the Trainer;
- :meth:`FabricStrategy.global_model` for evaluation and :meth:`FabricStrategy.finish` at the end
  stand in for the Trainer's validation and end-of-fit hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
from lightning.fabric.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, ParallelStrategy
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.utilities.types import ReduceOp, _Stateful
from lightning.pytorch import accelerators as pl_accelerators
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_commstrats._registry import _qualname, unknown_strategy_message
from lightning_commstrats.comm import CommStats, Communicator
from lightning_commstrats.sharding import checkpoint as sharded_checkpoint
from lightning_commstrats.sharding.materialize import parameters_on_meta
from lightning_commstrats.strategies.base import STATE_KEY, CommStrategy, RankDevices, move_to_device

__all__ = ["FabricStrategy", "register_fabric_strategies"]


class FabricStrategy(RankDevices, ParallelStrategy):
    """Runs one of the package's schemes under Lightning Fabric.

    Args:
        scheme: a registered name (``"allreduce"``, ``"onebit_sgd"``, ``"bmuf"``...) or an instance
            of one of the package's strategies (its settings are used as they are).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision: as in Fabric's
            ``DDPStrategy``; Fabric fills them in.
        **scheme_kwargs: the scheme's settings, with a name (as ``BMUFStrategy(**scheme_kwargs)``).
    """

    def __init__(
        self,
        scheme: str | CommStrategy = "allreduce",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        **scheme_kwargs: Any,
    ) -> None:
        if isinstance(scheme, str):
            scheme = scheme_class(scheme)(**scheme_kwargs)
        elif not isinstance(scheme, CommStrategy):
            raise TypeError(
                f"scheme must be a strategy name or an instance of a lightning_commstrats strategy, got {scheme!r}"
            )
        elif scheme_kwargs:
            raise TypeError(
                f"settings {sorted(scheme_kwargs)} go to the scheme's constructor, not beside an instance:"
                f" FabricStrategy({type(scheme).__name__}(...))"
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self.scheme = scheme
        self._num_nodes = 1
        self._module: Module | None = None
        self._hook: Any = None
        self._begun = False
        self._batch_index = 0

    def __repr__(self) -> str:
        return f"FabricStrategy({type(self.scheme).__name__})"

    # ------------------------------------------------------------------ what users read

    @property
    def comm(self) -> Communicator:
        """This rank's communicator (the scheme's)."""
        return self.scheme.comm

    @property
    def comm_stats(self) -> CommStats:
        """Cumulative communication statistics of this rank, as ``trainer.strategy.comm_stats``."""
        return self.scheme.comm_stats

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps of the run so far. Loop on it (``while fabric.strategy.optimizer_steps <
        max_steps``): a fault-tolerant replica that heals from a peer takes over the run's count."""
        return self.scheme.optimizer_steps

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # the scheme's (a fault-tolerant replica adds its own data order's seed)
        return self.scheme.distributed_sampler_kwargs

    # ------------------------------------------------------------------ processes and devices

    def _connect_scheme(self) -> None:
        """Hand Fabric's devices and cluster environment to the scheme (which checks them)."""
        scheme = self.scheme
        if self.accelerator is not None:
            if isinstance(self.accelerator, CUDAAccelerator):
                scheme.accelerator = pl_accelerators.CUDAAccelerator()
            elif isinstance(self.accelerator, CPUAccelerator):
                scheme.accelerator = pl_accelerators.CPUAccelerator()
            else:
                got = type(self.accelerator).__name__
                raise ValueError(f"{type(scheme).__name__} runs on accelerator='cpu' or 'cuda', got {got}")
        scheme.parallel_devices = self.parallel_devices
        scheme.cluster_environment = self.cluster_environment
        scheme.num_nodes = self.num_nodes

    def _set_world_ranks(self) -> None:  # Fabric's connector calls it once the devices are known
        self._connect_scheme()
        if self.cluster_environment is not None and self.num_processes:
            self.scheme.set_world_ranks()

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self.scheme.check_launch()
        if self.scheme._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self.scheme._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._connect_scheme()
        self.scheme.setup_environment()

    # ------------------------------------------------------------------ the model and optimizers

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[Module, list[Optimizer], Any]:
        module = self.setup_module(module)
        return module, [self.setup_optimizer(o) for o in optimizers], scheduler

    @override
    def setup_module(self, module: Module) -> Module:
        if self._module is not None and module is not self._module:
            raise ValueError(f"{self!r} trains one model; it already holds a {type(self._module).__name__}")
        if getattr(self.precision, "scaler", None) is not None:
            raise ValueError(
                f"{type(self.scheme).__name__} cannot use Fabric's precision={self.precision.precision!r} (a"
                " GradScaler without rank agreement: an overflow would reach the exchange); use 'bf16-mixed'"
            )
        scheme = self.scheme
        scheme._lightning_module = module
        scheme.model = module
        self.module_to_device(module)
        scheme.configure_model_parallel()
        scheme.synchronize_initial_weights()
        scheme.setup_scheme()
        self._module = module
        # before FSDP2's own pre-forward hook (shard="fsdp"), which swaps in the gathered parameters:
        # the run starts (the global model taken) from the parameters as the scheme holds them
        prepend = scheme.sharding is not None
        self._hook = module.register_forward_pre_hook(self._on_forward, with_kwargs=True, prepend=prepend)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self._module is None:
            raise RuntimeError(f"{self!r}: set up the model before its optimizers (fabric.setup(model, optimizer))")
        params = {id(p) for p in self._module.parameters()}
        foreign = [i for i, g in enumerate(optimizer.param_groups) if any(id(p) not in params for p in g["params"])]
        if foreign:
            raise ValueError(
                f"the optimizer's parameter groups {foreign} hold tensors that are not the model's parameters"
                f" (after {type(self.scheme).__name__} set up the model): create the optimizer after"
                " `model = fabric.setup_module(model)` and pass it to `fabric.setup_optimizers(optimizer)`"
            )
        if optimizer not in self.scheme.optimizers:
            self.scheme.optimizers = [*self.scheme.optimizers, optimizer]
        return optimizer

    @override
    def module_to_device(self, module: Module) -> None:
        move_to_device(module, self.root_device)

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module``: as the Trainer's ``init_module`` (see
        :meth:`CommStrategy.tensor_init_context`): with ``shard="fsdp"`` and ``empty_init=True`` the
        parameters are built on the meta device and each rank materialises only its shards."""
        if empty_init and self.scheme.sharding is not None:
            stack = ExitStack()
            stack.enter_context(parameters_on_meta())
            stack.enter_context(self.precision.module_init_context())
            return stack
        if empty_init:
            self.scheme.note_built_uninitialised()
        return super().module_init_context(empty_init)

    def _on_forward(self, module: Module, args: tuple, kwargs: dict) -> None:
        """A forward in training mode is a batch: the run starts at the first, and the scheme counts
        its samples and sees its tensors (as the Trainer's ``on_train_batch_start``)."""
        if not module.training or not torch.is_grad_enabled():
            return
        self.begin()
        batch = args if not kwargs else (*args, kwargs)
        try:
            extract_batch_size(batch)
        except Exception:  # no tensor to count: the scheme must not count samples
            if self.scheme.schedule_counts_samples():
                raise
            return
        self.scheme.on_train_batch_start(batch, self._batch_index)
        self._batch_index += 1

    def begin(self) -> None:
        """Start the run: restore a loaded checkpoint's scheme state, start the clock; the periodic
        schemes take the current weights as the global model. Called by the first training forward;
        call it yourself to start earlier."""
        if self._begun:
            return
        if self._module is None:
            raise RuntimeError(f"{self!r}: call fabric.setup(model, optimizer) first")
        self._begun = True
        self.scheme.on_train_start()

    # ------------------------------------------------------------------ the step

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self.begin()
        runs = self.scheme.exchange_before_step(optimizer)
        output = self.precision.optimizer_step(optimizer, **kwargs)
        self.scheme.end_step(optimizer, runs)
        return output

    @contextmanager
    def global_model(self) -> Iterator[None]:
        """Evaluate on the model every rank agrees on: the ranks' buffers averaged and, for the periodic
        schemes, the global weights swapped in (the local ones come back on exit)::

            with fabric.strategy.global_model():
                val_loss = evaluate(model, val_loader)
        """
        self.scheme.sync_buffers()
        self.scheme.on_validation_start()
        try:
            yield
        finally:
            self.scheme.on_validation_end()

    def finish(self) -> None:
        """End the run as the Trainer ends a fit: the periodic schemes sync every fragment that trained
        since its last sync and every rank takes the global model; buffers are averaged."""
        if self._begun:
            self.scheme.on_train_end()
            self._begun = False
        self.scheme.release_resources()  # Fabric has no end of run of its own to do it

    # ------------------------------------------------------------------ collectives (through the scheme)

    @override
    def all_reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"):
        return self.scheme.reduce(tensor, group=_world_or(group), reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return self.scheme.all_gather(tensor, group=_world_or(group), sync_grads=sync_grads)

    @override
    def barrier(self, name: str | None = None) -> None:
        self.scheme.barrier(name)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.scheme.broadcast(obj, src)

    # ------------------------------------------------------------------ checkpoints

    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Collective. The model as the scheme saves it, every optimizer's state, the scheme's shared
        state in the file (written by rank 0) and each rank's own state in its shard beside it."""
        scheme = self.scheme
        if scheme._comm is not None:
            scheme.sync_buffers()
        converted = self._convert_stateful_objects_in_state(state, filter=filter or {})
        if scheme.sharding is not None and scheme._comm is not None:  # a directory, every rank its shards
            sharded_checkpoint.save_strategy(scheme, converted, str(path))
            return
        if scheme._comm is not None:
            converted[STATE_KEY] = scheme.states.entry(path)
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint=converted, path=path, storage_options=storage_options)

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        """The trained model as the scheme saves it (the global model for the periodic schemes)."""
        return self.scheme.lightning_module_state_dict() if module is self._module else module.state_dict()

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        if module is self._module:  # expert_parallel takes this rank's experts from its shard
            self.scheme.load_model_state_dict({"state_dict": state_dict}, strict=strict)
        else:
            module.load_state_dict(state_dict, strict=strict)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore the model, the optimizers and the scheme's state (this rank's from its shard). The
        scheme's state is applied when the run starts, or at once when it has started."""
        scheme = self.scheme
        scheme.checkpoint_io = self.checkpoint_io
        checkpoint = scheme.load_checkpoint(path, weights_only=weights_only)
        checkpoint.pop(STATE_KEY, None)
        if not state:
            scheme.states.pending = None
            return checkpoint
        if isinstance(state, (Module, Optimizer)):
            raise ValueError(
                f"{path} is a checkpoint written by fabric.save; pass the dictionary of objects it was saved from"
            )
        missing = [k for k in state if k not in checkpoint]
        if strict and missing:
            raise KeyError(f"the checkpoint {path} has no {missing}; it has {sorted(checkpoint)}")
        for name, obj in list(state.items()):
            if name not in checkpoint:
                continue
            if isinstance(obj, Module):
                self.load_module_state_dict(obj, checkpoint.pop(name), strict=strict)
            elif isinstance(obj, _Stateful):
                obj.load_state_dict(checkpoint.pop(name))
            else:
                state[name] = checkpoint.pop(name)
        if self._begun:  # mid-run: the scheme takes its state now
            scheme.states.restore_pending()
        return checkpoint

    @override
    def teardown(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.scheme.release_resources()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_fabric_strategies(strategy_registry)


def _world_or(group: Any) -> Any:
    """None for the world group (Fabric names it ``torch.distributed.group.WORLD``), else ``group``."""
    return None if group is None or group is torch.distributed.group.WORLD else group


def scheme_class(name: str) -> type[CommStrategy]:
    """The package's strategy class registered as ``name``."""
    from lightning_commstrats.strategies import STRATEGIES

    classes = {cls.strategy_name: cls for cls in STRATEGIES}
    if name not in classes:
        raise ValueError(unknown_strategy_message("scheme", name, classes))
    return classes[name]


def register_fabric_strategies(registry: Any = None) -> list[str]:
    """Register every scheme's name with Fabric's ``STRATEGY_REGISTRY`` (returns the names added).
    A name already taken by something else is an error, as for the Trainer's registry."""
    from lightning_commstrats.strategies import STRATEGIES

    registry = STRATEGY_REGISTRY if registry is None else registry
    added = []
    for cls in STRATEGIES:
        name = cls.strategy_name
        if name in registry:
            existing = registry[name]
            same = _qualname(existing["strategy"]) == _qualname(FabricStrategy)
            if same and existing["init_params"].get("scheme") == name:
                continue
            raise RuntimeError(
                f"Fabric strategy name {name!r} is already registered to {existing['strategy']!r};"
                f" pass an instance instead: Fabric(strategy=FabricStrategy({cls.__name__}(...)))"
            )
        description = (cls.__doc__ or "").strip().split("\n")[0]
        registry.register(name, FabricStrategy, description=description, scheme=name)
        added.append(name)
    return added
