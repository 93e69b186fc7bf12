"""The engine core process imports no transformers (about a second of CPU at every start): it loads a tokenizer
only for a grammar, when the first structured request comes (folio/engine/core.py)."""

import subprocess
import sys
from pathlib import Path


def test_the_engine_core_process_modules_do_not_import_transformers() -> None:
    code = (
        "import sys\n"
        "import folio.engine.core_proc, folio.executor.uniproc, folio.model.loader\n"
        "loaded = sorted(m for m in sys.modules if m == 'transformers' or m.startswith('transformers.'))\n"
        "assert not loaded, loaded[:5]\n"
    )
    repo_root = Path(__file__).resolve().parents[2]
    completed = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr[-2000:]
