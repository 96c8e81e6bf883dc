"""Bad input is refused when the object is built, with an error that names the argument and what is
allowed: no rank is launched, nothing is written."""
# ruff: noqa: E501 (one case a line reads best as a table)

from datetime import timedelta

import pytest

from lightning_commstrats import (
    AllReduceStrategy,
    BMUFStrategy,
    CommStatsMonitor,
    DiLoCoStrategy,
    ExpertParallelStrategy,
    LayeredMixedPrecision,
    LocalSGDStrategy,
    ModelAveragingStrategy,
    OneBitSGDStrategy,
    ParameterServerStrategy,
    SampledVocabStrategy,
    StreamingDiLoCoStrategy,
)
from lightning_commstrats.data import LMDataModule
from lightning_commstrats.models import LanguageModel

CASES = [
    # every strategy's shared arguments
    (AllReduceStrategy, {"backend": "tcp"}, ValueError, r"backend='tcp' is not supported; choose one of"),
    (AllReduceStrategy, {"process_group_backend": "tcp"}, ValueError, r"backend='tcp' is not supported; choose one of"),
    (AllReduceStrategy, {"backend": "gloo", "process_group_backend": "nccl"}, ValueError, "backend='gloo' and process_group_backend='nccl' disagree"),
    (AllReduceStrategy, {"group_size": 0}, ValueError, "group_size must be a positive int, 'node' or None, got 0"),
    (OneBitSGDStrategy, {"group_size": "rack"}, ValueError, "group_size must be a positive int, 'node' or None, got 'rack'"),
    (AllReduceStrategy, {"group_size": 2, "slow_hop_bits": 3}, ValueError, r"slow_hop_bits=3 is not supported; choose one of \(1, 2, 4, 8, 16, 32\)"),
    (AllReduceStrategy, {"slow_hop_bits": 8}, ValueError, "slow_hop_bits=8 needs group_size"),
    (AllReduceStrategy, {"timeout": -1}, ValueError, "timeout must be a positive timedelta or number of seconds"),
    (AllReduceStrategy, {"timeout": "5m"}, ValueError, "timeout must be a positive timedelta or number of seconds"),
    (AllReduceStrategy, {"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb must be > 0"),
    (AllReduceStrategy, {"start_method": "thread"}, ValueError, "start_method='thread' is not supported"),
    (AllReduceStrategy, {"resume_mismatch": "ignore"}, ValueError, "resume_mismatch='ignore' is not supported"),
    (AllReduceStrategy, {"nonfinite": "zero"}, ValueError, r"nonfinite='zero' is not supported; choose one of \('raise', 'skip'\)"),
    (AllReduceStrategy, {"verify_sync_every": -1}, ValueError, "verify_sync_every must be an int >= 0"),
    (AllReduceStrategy, {"stop_check_every": 0}, ValueError, "stop_check_every must be an int >= 1"),
    (DiLoCoStrategy, {"stop_check_every": 2.5}, ValueError, "stop_check_every must be an int >= 1"),
    (ModelAveragingStrategy, {"verify_sync_action": "log"}, ValueError, "verify_sync_action='log' is not supported"),
    # an unknown keyword is reported against the class the user called
    (DiLoCoStrategy, {"sync_every": 4}, TypeError, r"DiLoCoStrategy got unexpected keyword argument\(s\) \['sync_every'\]"),
    (SampledVocabStrategy, {"gamma": 3}, TypeError, r"SampledVocabStrategy got unexpected keyword argument\(s\) \['gamma'\]"),
    # a misspelled one is given the nearest names the class (and its bases) take
    (DiLoCoStrategy, {"sync_peroid": 16}, TypeError, r"did you mean: sync_peroid -> sync_period\?"),
    (AllReduceStrategy, {"slow_hop_bit": 4}, TypeError, r"did you mean: slow_hop_bit -> slow_hop_bits\?"),
    # 1-bit SGD and the gradient codecs
    (OneBitSGDStrategy, {"num_quantization_bits": 3}, ValueError, "num_quantization_bits=3 is not supported"),
    (OneBitSGDStrategy, {"distributed_after": -1}, ValueError, "distributed_after must be an int >= 0"),
    (OneBitSGDStrategy, {"distributed_after_unit": "epochs"}, ValueError, "distributed_after_unit='epochs' is not supported"),
    (OneBitSGDStrategy, {"half_dtype": "fp8"}, ValueError, "half_dtype='fp8' is not supported"),
    (OneBitSGDStrategy, {"small_tensor_numel": -1}, ValueError, "small_tensor_numel must be an int >= 0"),
    # sampled vocabulary
    (SampledVocabStrategy, {"alpha": 1.5}, ValueError, r"alpha must be a count >= 0 \(an int\) or a fraction in \[0, 1\]"),
    (SampledVocabStrategy, {"beta": -2}, ValueError, "beta must be a count >= 0"),
    # the parameter server
    (ParameterServerStrategy, {"mode": "hogwild"}, ValueError, r"mode='hogwild' is not supported; choose one of \('sync', 'async'\)"),
    (ParameterServerStrategy, {"mode": "async", "sync_period": 0}, ValueError, "sync_period must be a positive int, got 0"),
    (ParameterServerStrategy, {"mode": "async", "sync_period": -4}, ValueError, "sync_period must be a positive int, got -4"),
    (ParameterServerStrategy, {"mode": "sync", "sync_period": 4}, ValueError, r"mode='sync' averages gradients at every optimizer step; sync_period apply to mode='async'"),
    (ParameterServerStrategy, {"pipeline": True}, ValueError, r"mode='sync' .*pipeline apply to mode='async'"),
    (ParameterServerStrategy, {"num_servers": 0}, ValueError, "num_servers must be a positive int or 'all', got 0"),
    (ParameterServerStrategy, {"num_servers": "half"}, ValueError, "num_servers must be a positive int or 'all', got 'half'"),
    (ParameterServerStrategy, {"num_servers": True}, ValueError, "num_servers must be a positive int or 'all', got True"),
    (ParameterServerStrategy, {"mode": "async", "sync_period_unit": "epochs"}, ValueError, "sync_period_unit='epochs' is not supported"),
    (ParameterServerStrategy, {"mode": "async", "adjust_learning_rate": "cosine"}, ValueError, r"adjust_learning_rate='cosine' is not supported; choose one of \('none', 'linear', 'staircase'\)"),
    (ParameterServerStrategy, {"mode": "async", "adjust_coefficient": 0}, ValueError, r"adjust_coefficient must be in \(0, 1\], got 0"),
    (ParameterServerStrategy, {"mode": "async", "adjust_coefficient": 1.5}, ValueError, r"adjust_coefficient must be in \(0, 1\], got 1.5"),
    (ParameterServerStrategy, {"mode": "async", "adjust_nb_minibatch": 0}, ValueError, "adjust_nb_minibatch must be an int >= 1, got 0"),
    (ParameterServerStrategy, {"rpc_transports": "uv"}, ValueError, "rpc_transports must be a list of TensorPipe transport names or None"),
    (ParameterServerStrategy, {"backend": "mpi"}, ValueError, "parameter_server sends its messages over torch.distributed.rpc"),
    (ParameterServerStrategy, {"group_size": 2}, ValueError, "parameter_server has no group exchange: group_size does not apply"),
    # the periodic family
    (ModelAveragingStrategy, {"sync_period": 0}, ValueError, "sync_period must be a positive int, got 0"),
    (ModelAveragingStrategy, {"sync_period": 2.5}, ValueError, "sync_period must be a positive int, got 2.5"),
    (ModelAveragingStrategy, {"sync_period_unit": "epochs"}, ValueError, "sync_period_unit='epochs' is not supported"),
    (LocalSGDStrategy, {"sync_period": -8}, ValueError, "sync_period must be a positive int"),
    (BMUFStrategy, {"block_momentum": 1.0}, ValueError, r"block_momentum must be in \[0, 1\), got 1.0"),
    (BMUFStrategy, {"block_learning_rate": 0}, ValueError, "block_learning_rate must be > 0"),
    (DiLoCoStrategy, {"pseudo_grad_bits": 3}, ValueError, "pseudo_grad_bits=3 is not supported"),
    (DiLoCoStrategy, {"pseudo_grad_scales": "blocks"}, ValueError, r"pseudo_grad_scales='blocks' is not supported; choose one of \('columns', 'rows'\)"),
    (DiLoCoStrategy, {"outer_lr": 0}, ValueError, "outer_lr must be a number > 0, got 0"),
    (DiLoCoStrategy, {"outer_momentum": 1.5}, ValueError, r"outer_momentum must be a number in \[0, 1\), got 1.5"),
    (DiLoCoStrategy, {"outer_optimizer": "torch.nn.Linear"}, ValueError, "is not a torch.optim.Optimizer subclass"),
    (DiLoCoStrategy, {"outer_optimizer": "torch.optim.Nope"}, ValueError, "outer_optimizer='torch.optim.Nope' cannot be imported"),
    (DiLoCoStrategy, {"parallelization_start": -1}, ValueError, "parallelization_start must be an int >= 0"),
    (StreamingDiLoCoStrategy, {"num_fragments": 0}, ValueError, "num_fragments must be an int >= 1"),
    (StreamingDiLoCoStrategy, {"sync_period": 8, "num_fragments": 16}, ValueError, "num_fragments=16 must be <= sync_period=8"),
    (StreamingDiLoCoStrategy, {"fragment_sync_delay": 30}, ValueError, "fragment_sync_delay=30 must be < sync_period / num_fragments"),
    (StreamingDiLoCoStrategy, {"fragment_update_alpha": 2}, ValueError, r"fragment_update_alpha must be a number in \[0, 1\]"),
    (StreamingDiLoCoStrategy, {"fragment_update_alpha": "half"}, ValueError, "fragment_update_alpha must be a number"),
    (StreamingDiLoCoStrategy, {"sync_period_unit": "samples"}, ValueError, "sync_period_unit='samples' is not allowed"),
    # expert parallelism
    (ExpertParallelStrategy, {"ep_size": 0}, ValueError, "ep_size must be a positive int, got 0"),
    (ExpertParallelStrategy, {"inner": "node"}, ValueError, "inner='node' is not supported"),
    (ExpertParallelStrategy, {"ep_size": 2, "dp_size": 0}, ValueError, "dp_size must be a positive int, got 0"),
    # the precision plugin
    (LayeredMixedPrecision, {"preset": "O9"}, ValueError, "preset='O9' is not supported"),
    (LayeredMixedPrecision, {"dtype": "fp8"}, ValueError, "dtype='fp8' is not supported"),
    (LayeredMixedPrecision, {"policy": {"attention": "int8"}}, ValueError, r"policy\['attention'\]='int8' is not supported"),
    (LayeredMixedPrecision, {"dtype": "fp16", "init_scale": 0}, ValueError, "init_scale must be > 0"),
    # data, model, callback
    (LMDataModule, {"batch_size": 0}, ValueError, "batch_size must be > 0"),
    (LMDataModule, {"num_workers": -1}, ValueError, "num_workers must be an int >= 0"),
    (LMDataModule, {"seq_len": 0}, ValueError, "seq_len must be > 0"),
    (LMDataModule, {"data_dir": "/nonexistent/corpus"}, FileNotFoundError, "data file not found: /nonexistent/corpus/train.txt"),
    (LanguageModel, {"vocab_size": 10, "arch": "gru"}, ValueError, "arch='gru' is not supported"),
    (LanguageModel, {"vocab_size": 0}, ValueError, "vocab_size must be >= 2"),
    (LanguageModel, {"vocab_size": 10, "optimizer": "lion"}, ValueError, "optimizer='lion' is not supported"),
    (LanguageModel, {"vocab_size": 10, "arch": "transformer", "num_experts": 4, "balance": "bias", "bias_update_rule": "median"}, ValueError, r"bias_update_rule='median' is not supported; choose one of \('sign', 'quantile'\)"),
    (LanguageModel, {"vocab_size": 10, "arch": "transformer", "num_experts": 4, "balance": "bias", "bias_update_rule": "quantile", "bias_update_rate": 2.0}, ValueError, r"bias_update_rate must be in \[0, 1\] with bias_update_rule='quantile'"),
    (LanguageModel, {"vocab_size": 10, "dropout": 1.5}, ValueError, r"dropout must be in \[0, 1\)"),
    (LanguageModel, {"vocab_size": 10, "aux_loss_weight": -0.1}, ValueError, "aux_loss_weight must be a finite number >= 0"),
    # mixture of experts
    (LanguageModel, {"vocab_size": 10, "arch": "transformer", "num_experts": 4, "balance": "loss_free"}, ValueError, "balance='loss_free' is not supported"),
    (LanguageModel, {"vocab_size": 10, "arch": "transformer", "num_experts": 4, "balance": "bias", "bias_update_rate": -1e-3}, ValueError, "bias_update_rate must be a finite number >= 0, got -0.001"),
    (CommStatsMonitor, {"summary_every_n_steps": -1}, ValueError, "summary_every_n_steps must be a positive int or None"),
]  # fmt: skip


@pytest.mark.parametrize(("cls", "kwargs", "error", "message"), CASES, ids=lambda v: getattr(v, "__name__", None))
def test_bad_configuration_fails_at_construction_naming_the_argument(cls, kwargs, error, message):
    with pytest.raises(error, match=message):
        cls(**kwargs)


def test_the_matrix_is_wide():
    assert len(CASES) >= 30
    assert len({c[0] for c in CASES}) >= 12


def test_timeout_in_seconds_is_a_timedelta():
    assert AllReduceStrategy(timeout=90)._timeout == timedelta(seconds=90)


def test_the_recipe_refuses_a_bad_setting_before_training(tmp_path):
    from pathlib import Path

    from lightning_commstrats.cli import main

    tiny = str(Path(__file__).resolve().parents[1] / "lightning_commstrats" / "configs" / "lstm_tiny.yaml")
    with pytest.raises((ValueError, SystemExit)):
        main(["fit", "--config", tiny, "--data.seq_len=0", f"--trainer.default_root_dir={tmp_path}"])
    with pytest.raises((ValueError, SystemExit)):
        main(["fit", "--config", tiny, "--trainer.strategy=no_such_scheme", f"--trainer.default_root_dir={tmp_path}"])
    assert not any(tmp_path.iterdir())


def test_process_group_backend_is_backend_under_lightning_ddp_name():
    assert AllReduceStrategy(process_group_backend="gloo").backend == "gloo"
    assert BMUFStrategy(backend="gloo", process_group_backend="gloo").backend == "gloo"


# A layout that does not fit the ranks the Trainer (or Fabric) asks for: refused when the Trainer is
# built, before any rank is spawned (it used to surface only in every spawned rank's set-up).
LAYOUT_CASES = [
    (AllReduceStrategy, {"group_size": 3}, "AllReduceStrategy: group_size=3 must divide the number of ranks, 4 \\(devices=4 x num_nodes=1\\)"),
    (DiLoCoStrategy, {"group_size": 3, "shard": "fsdp"}, "DiLoCoStrategy: group_size=3 must divide the number of ranks, 4"),
    (OneBitSGDStrategy, {"group_size": 8}, "group_size=8 must divide the number of ranks, 4"),
    (ExpertParallelStrategy, {"ep_size": 3}, "ep_size=3 must divide the world size 4"),
    (ExpertParallelStrategy, {"dp_size": 3}, "dp_size x ep_size = 3 x 1 must equal the world size 4"),
    (ExpertParallelStrategy, {"ep_size": 2, "shard": "fsdp", "group_size": 4}, "group_size=4 disagrees: leave it out or pass 2"),
]  # fmt: skip


@pytest.mark.parametrize(("cls", "kwargs", "message"), LAYOUT_CASES, ids=lambda v: getattr(v, "__name__", None))
def test_a_layout_that_does_not_fit_the_ranks_fails_when_the_trainer_is_built(cls, kwargs, message):
    import lightning as L

    from lightning_commstrats.fabric import FabricStrategy

    with pytest.raises(ValueError, match=message):
        L.Trainer(strategy=cls(**kwargs), devices=4, accelerator="cpu", logger=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match=message):
        L.Fabric(strategy=FabricStrategy(cls(**kwargs)), devices=4, accelerator="cpu")
    fitting = {**kwargs, "group_size": 2} if "group_size" in kwargs else {"ep_size": 2}
    L.Trainer(strategy=cls(**fitting), devices=4, accelerator="cpu", logger=False, enable_progress_bar=False)
