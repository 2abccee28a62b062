"""The benchmark scripts as modules, for tests that call their functions in this process.

A script run as a subprocess imports torch again (seconds of CPU); what needs no process of its
own (argument checks, pure helpers) is tested here, in the test process.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module, imported once per process."""
    key = f"benchmarks_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def usage_error(name: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the script's ``main(argv)``, which must stop with a usage error (exit status 2), as
    ``argparse`` does; return what it wrote to stderr."""
    with pytest.raises(SystemExit) as info:
        load(name).main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err
