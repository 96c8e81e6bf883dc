"""lightning-commstrats: communication-efficient distributed training strategies for Lightning.

Importing the package registers every strategy name with Lightning's ``StrategyRegistry``::

    import lightning as L
    import lightning_commstrats

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="allreduce")

and with Fabric's ``STRATEGY_REGISTRY`` (``L.Fabric(strategy="bmuf")``, see
:mod:`lightning_commstrats.fabric`), and exports the mixed-precision plugin
``LayeredMixedPrecision`` (``plugins=[...]``).
"""

from lightning_commstrats._registry import register_strategies, suggest_names_in_trainer
from lightning_commstrats.batching import AutoAdjust, GradientNoiseScale
from lightning_commstrats.callbacks import CommStatsMonitor
from lightning_commstrats.comm import CommSnapshot, CommStats, Communicator
from lightning_commstrats.fabric import FabricStrategy, register_fabric_strategies
from lightning_commstrats.fault_tolerance import FaultTolerance
from lightning_commstrats.precision import LayeredMixedPrecision
from lightning_commstrats.strategies import (
    STRATEGIES,
    AllReduceStrategy,
    BMUFStrategy,
    CommStrategy,
    DiLoCoStrategy,
    ExpertParallelStrategy,
    LocalSGDStrategy,
    ModelAveragingStrategy,
    OneBitAdamStrategy,
    OneBitSGDStrategy,
    ParameterServerStrategy,
    PeriodicSyncStrategy,
    SampledVocabStrategy,
    SparseLoCoStrategy,
    StreamingDiLoCoStrategy,
    ZeroOneAdamStrategy,
)

__version__ = "0.1.0"

__all__ = [
    "STRATEGIES",
    "AllReduceStrategy",
    "AutoAdjust",
    "BMUFStrategy",
    "CommSnapshot",
    "CommStats",
    "CommStatsMonitor",
    "CommStrategy",
    "Communicator",
    "DiLoCoStrategy",
    "ExpertParallelStrategy",
    "FabricStrategy",
    "FaultTolerance",
    "GradientNoiseScale",
    "LayeredMixedPrecision",
    "LocalSGDStrategy",
    "ModelAveragingStrategy",
    "OneBitAdamStrategy",
    "OneBitSGDStrategy",
    "ParameterServerStrategy",
    "PeriodicSyncStrategy",
    "SampledVocabStrategy",
    "SparseLoCoStrategy",
    "StreamingDiLoCoStrategy",
    "ZeroOneAdamStrategy",
    "register_fabric_strategies",
    "register_strategies",
]

register_strategies()
register_fabric_strategies()
suggest_names_in_trainer()  # Trainer(strategy=<unknown name>) names the nearest names
