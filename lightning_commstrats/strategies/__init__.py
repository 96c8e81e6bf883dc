"""Lightning strategies, one file per communication scheme; registry names are the public API."""

from lightning_commstrats.strategies.allreduce import AllReduceStrategy
from lightning_commstrats.strategies.base import CommStrategy
from lightning_commstrats.strategies.bmuf import BMUFStrategy
from lightning_commstrats.strategies.diloco import DiLoCoStrategy
from lightning_commstrats.strategies.expert_parallel import ExpertParallelStrategy
from lightning_commstrats.strategies.local_sgd import LocalSGDStrategy
from lightning_commstrats.strategies.model_averaging import ModelAveragingStrategy
from lightning_commstrats.strategies.onebit_adam import OneBitAdamStrategy
from lightning_commstrats.strategies.onebit_sgd import OneBitSGDStrategy
from lightning_commstrats.strategies.parameter_server import ParameterServerStrategy
from lightning_commstrats.strategies.periodic import PeriodicSyncStrategy
from lightning_commstrats.strategies.sampled_vocab import SampledVocabStrategy
from lightning_commstrats.strategies.sparseloco import SparseLoCoStrategy
from lightning_commstrats.strategies.streaming_diloco import StreamingDiLoCoStrategy
from lightning_commstrats.strategies.zero_one_adam import ZeroOneAdamStrategy

STRATEGIES: tuple[type[CommStrategy], ...] = (
    AllReduceStrategy,
    OneBitSGDStrategy,
    ModelAveragingStrategy,
    BMUFStrategy,
    LocalSGDStrategy,
    DiLoCoStrategy,
    StreamingDiLoCoStrategy,
    SparseLoCoStrategy,
    SampledVocabStrategy,
    ExpertParallelStrategy,
    ParameterServerStrategy,
    OneBitAdamStrategy,
    ZeroOneAdamStrategy,
)

__all__ = [
    "STRATEGIES",
    "AllReduceStrategy",
    "BMUFStrategy",
    "CommStrategy",
    "DiLoCoStrategy",
    "ExpertParallelStrategy",
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
]
