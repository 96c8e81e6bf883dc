"""Train a word-level language model on the Brown corpus with any strategy of the package.

    python recipes/train_lm.py fit --config recipes/configs/lstm_demo.yaml
    python recipes/train_lm.py fit --config recipes/configs/lstm_demo.yaml --trainer.devices=4
    python recipes/train_lm.py test --config recipes/configs/lstm_demo.yaml --ckpt_path <checkpoint>
    mpiexec -n 2 python recipes/train_lm.py fit --config recipes/configs/lstm_tiny.yaml --trainer.strategy=allreduce

The same program is installed as the console script ``commstrats-lm``. The model is
:class:`lightning_commstrats.models.LanguageModel`, the data :class:`lightning_commstrats.data.LMDataModule`
(``--help`` lists every argument; ``--print_config`` prints a complete config).
"""

from lightning_commstrats.cli import main

if __name__ == "__main__":
    main()
