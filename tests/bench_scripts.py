"""The scripts under ``benchmarks/`` as modules, for the tests that check them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load(name: str, *, siblings: bool = False) -> ModuleType:
    """``benchmarks/<name>.py`` imported as the module ``name``, registered in ``sys.modules``
    (its dataclasses look their module up while the class is built). ``siblings``: with
    ``benchmarks/`` on ``sys.path`` while it loads, for a script that imports its neighbours
    (``regimes``, ``profiling``, ...)."""
    folder = str(ROOT / "benchmarks")
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    if siblings:
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    finally:
        if siblings:
            sys.path.remove(folder)
    return module
