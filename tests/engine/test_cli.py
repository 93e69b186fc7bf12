"""`folio generate` and `folio chat` as a user runs them: real subprocesses of the installed console script."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.small_engine import SMALL_ENGINE_FLAGS


def folio_command() -> list[str]:
    script = Path(sys.executable).parent / "folio"
    if script.exists():
        return [str(script)]
    found = shutil.which("folio")
    if found is None:
        pytest.fail("the folio console script is not installed")
    return [found]


def test_generate_subprocess() -> None:
    result = subprocess.run(
        [*folio_command(), "generate", "The capital of France is", "--max-tokens", "8", *SMALL_ENGINE_FLAGS],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "KV cache" in result.stderr  # capacity is reported at start-up


def test_chat_subprocess() -> None:
    result = subprocess.run(
        # float32: CUDA's auto dtype, bfloat16, meets a near-tie in this answer (docs/performance.md, session 9)
        [*folio_command(), "chat", "--max-tokens", "24", "--dtype", "float32", *SMALL_ENGINE_FLAGS],
        input="What is the capital of France?\nexit\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "The capital of France is Paris" in result.stdout


def test_generate_bad_flag_value() -> None:
    result = subprocess.run(
        [*folio_command(), "generate", "Hi", "--temperature", "-3"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2
    assert "temperature must be a finite number >= 0" in result.stderr
