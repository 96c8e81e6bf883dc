"""Train a word-level language model on the Brown corpus with any strategy of the package.

    python recipes/train_lm.py fit --config lstm_demo
    python recipes/train_lm.py fit --config lstm_demo --trainer.devices=4
    python recipes/train_lm.py test --config lstm_demo --ckpt_path <checkpoint>
    python recipes/train_lm.py fit --config moe_demo --trainer.strategy.init_args.inner=ep
    mpiexec -n 2 python recipes/train_lm.py fit --config lstm_tiny --trainer.strategy=allreduce

The same program is installed as the console script ``commstrats-lm``: ``--config`` takes a YAML
file or the name of a config in ``lightning_commstrats/configs/``. The model is
:class:`lightning_commstrats.models.LanguageModel` (LSTM, feed-forward n-gram, Transformer, or a
mixture-of-experts Transformer), the data :class:`lightning_commstrats.data.LMDataModule`
(``--help`` lists every argument and the packaged configs; ``--print_config`` prints a complete config).
"""

from lightning_commstrats.cli import main

if __name__ == "__main__":
    main()
