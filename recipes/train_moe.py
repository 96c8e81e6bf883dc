"""Train a mixture-of-experts Transformer LM on the Brown corpus with expert parallelism.

    python recipes/train_moe.py fit --config recipes/configs/moe_demo.yaml
    python recipes/train_moe.py fit --config recipes/configs/moe_demo.yaml --trainer.strategy.init_args.inner=ep
    python recipes/train_moe.py fit --config recipes/configs/moe_tiny.yaml --model.balance=swipe

The same CLI as ``recipes/train_lm.py`` (``commstrats-lm``): the MoE model is the Transformer LM
with ``--model.num_experts`` experts in every ``--model.moe_every``-th block (``--model.top_k``,
``--model.capacity_factor``, ``--model.balance`` = aux / capacity / swipe), trained with the
``expert_parallel`` strategy (``ep_size`` x ``dp_size`` ranks, ``inner`` = dp or ep). Every step
logs ``moe/max_load``, ``moe/mean_load``, ``moe/balance`` (max / mean tokens per expert),
``moe/dropped`` and ``moe/aux_loss``; ``CommStatsMonitor`` adds ``comm/tokens_bytes``, the
all-to-all payload.
"""

from lightning_commstrats.cli import main

if __name__ == "__main__":
    main()
