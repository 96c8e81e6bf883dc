"""The advisor's vocabulary: the schemes it advises, the choices its options take, and the strategy class of
each scheme. Plain data, no torch: ``commstrats-advise --help`` reads it without importing torch."""

from __future__ import annotations

SCHEMES = (
    "allreduce",
    "onebit_sgd",
    "onebit_adam",
    "zero_one_adam",
    "sampled_vocab",
    "model_averaging",
    "bmuf",
    "local_sgd",
    "diloco",
    "streaming_diloco",
    "sparseloco",
)
# The class each scheme's name is registered for (tests/test_advisor_answer.py checks it against STRATEGIES).
STRATEGY_CLASSES = {
    "allreduce": "AllReduceStrategy",
    "onebit_sgd": "OneBitSGDStrategy",
    "onebit_adam": "OneBitAdamStrategy",
    "zero_one_adam": "ZeroOneAdamStrategy",
    "sampled_vocab": "SampledVocabStrategy",
    "model_averaging": "ModelAveragingStrategy",
    "bmuf": "BMUFStrategy",
    "local_sgd": "LocalSGDStrategy",
    "diloco": "DiLoCoStrategy",
    "streaming_diloco": "StreamingDiLoCoStrategy",
    "sparseloco": "SparseLoCoStrategy",
}
# The inner optimizer's state per parameter: (buffers of the parameter's size and dtype, whether a
# step counter tensor of 4 bytes is kept per parameter tensor), as torch.optim allocates them.
INNER_OPTIMIZERS = {"adamw": (2, True), "adam": (2, True), "sgd_momentum": (1, False), "sgd": (0, False)}
PARAM_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}
ACCELERATORS = ("gpu", "cpu")
# lightning_commstrats.outer.OUTER_STATES, repeated here so that the command's options need no torch
OUTER_STATES = ("host", "device")
