"""``python -m lightning_commstrats.advisor``: the same as ``commstrats-advise``."""

import sys

from lightning_commstrats.advisor.command import main

sys.exit(main())
