"""The console scripts' doors: ``commstrats-advise --help`` answers without importing torch or Lightning.

``import lightning_commstrats`` registers the package's strategies with Lightning, which imports torch
and Lightning (about 4 s on a laptop-class CPU). A question about the command's flags needs none of
that: for ``-h``/``--help`` alone, this module loads the advisor's command line (which imports only
constants until it reads a model) under a stand-in for the parent package, prints the help and exits.
Every other use goes through the package as usual. A module of its own, outside the package: importing
anything inside ``lightning_commstrats`` runs its ``__init__`` first.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

PACKAGE = "lightning_commstrats"


def _help_only(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)


def advise() -> int:
    """``commstrats-advise``."""
    argv = sys.argv[1:]
    if not _help_only(argv) or PACKAGE in sys.modules:
        from lightning_commstrats.advisor import main

        return main(argv)
    spec = importlib.util.find_spec(PACKAGE)  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        from lightning_commstrats.advisor import main

        return main(argv)
    stand_in = types.ModuleType(PACKAGE)
    stand_in.__path__ = list(spec.submodule_search_locations)
    sys.modules[PACKAGE] = stand_in
    try:
        command = importlib.import_module(f"{PACKAGE}.advisor.command")
        command.build_parser().parse_args(argv)  # prints the help and exits (SystemExit 0)
    finally:  # a caller that survives the exit sees no half-imported package
        for name in [n for n in sys.modules if n == PACKAGE or n.startswith(f"{PACKAGE}.")]:
            del sys.modules[name]
    return 0
