"""folio.core is pure Python (DESIGN.md convention 1): importing any of its modules must not load torch."""

import pkgutil
import subprocess
import sys
from pathlib import Path

import folio.core

CORE_MODULES = sorted(f"folio.core.{info.name}" for info in pkgutil.iter_modules(folio.core.__path__))


def test_core_modules_are_found() -> None:
    assert {"folio.core.block_pool", "folio.core.kv_cache_manager", "folio.core.scheduler"} <= set(CORE_MODULES)


def test_importing_folio_core_does_not_import_torch() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {CORE_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not loaded, loaded[:5]\n"
    )
    repo_root = Path(__file__).resolve().parents[2]
    completed = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr
