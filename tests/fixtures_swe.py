"""The swe example's stdlib modules for its tests: examples/ is not a package, so they load by path.

One place for the loader, the generator, the scorer (``reward.py`` imports its sibling ``sandbox.py``,
hence the path entry) and the mark of tests that score in the bubblewrap sandbox.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

SWE = Path(__file__).resolve().parents[1] / "examples" / "swe"


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = load("swe_generate", SWE / "generate.py")
sys.path.insert(0, str(SWE))
import reward  # noqa: E402,F401  (re-exported for the tests)

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="the scorer's sandbox needs bubblewrap (scripts/setup_envs.sh swe installs it)")
