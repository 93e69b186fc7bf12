"""Builds and loads the C kernels with the machine's C compiler, once per source, ISA tier and CPU, cached on disk.

Plain C through ctypes rather than a torch C++ extension: it compiles in about a second with gcc and needs no
torch headers or ninja. Each library is built for one ISA tier (folio/kernels/isa.py): the CPU's own tier with
``-march=native``, lower tiers for their generic x86-64 level. ``-march=native`` is safe because the cache key
includes the CPU's model and flags, so a library built on one CPU is never loaded on another.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from folio.kernels.isa import (
    EXTENSION_FLAGS,
    IsaTier,
    check_extensions,
    compile_flags,
    cpu_info,
    cpu_isa_extensions,
    cpu_isa_tier_name,
    detect_tier,
    is_x86_64,
)
from folio.logger import init_logger

logger = init_logger()

_CFLAGS = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
_LIBS = ["-lm"]


def _cpu_signature() -> str:
    """The CPU's model name and feature flags: part of the cache key, since -march=native binds to them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted) or platform.machine()


def _cache_dir() -> Path:
    return Path.home() / ".cache" / "folio" / "kernels"


def _compile(source: Path, target: Path, compiler: str, flags: list[str]) -> None:
    """Compiles to a temporary name then renames: processes building at the same time never load half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, str(source), "-o", tmp, *_LIBS], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def native_tier() -> IsaTier:
    """This CPU's best tier."""
    return detect_tier(cpu_info()[1], is_x86_64())


@functools.cache
def load_kernel_library(name: str, tier: IsaTier | None = None, extensions: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library of ``folio/kernels/<name>.c`` compiled for ``tier`` (default: this CPU's best, which it must
    not exceed), or None (with a warning) where it cannot be built. ``extensions`` (isa.EXTENSION_FLAGS) adds
    instructions this CPU has to a lower tier's library (``--cpu-isa avx2+avx_vnni``, tests and benchmarks).

    Callers fall back to their torch path on None, so a machine without a C compiler still runs, only slower.
    """
    native = native_tier()
    tier = native if tier is None else tier
    if tier > native:
        raise ValueError(f"cannot build the {tier.flag_name} tier on a CPU whose best tier is {native.flag_name}")
    check_extensions(tier, extensions, cpu_info()[1])
    flags = [*_CFLAGS, *compile_flags(tier, native, is_x86_64(), extensions)]
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning(
            "no C compiler found (cc or gcc on PATH): Folio's %s library is off and oneDNN / torch run instead, "
            "several times slower; install gcc to build it",
            name,
        )
        return None
    source = Path(__file__).with_name(f"{name}.c")
    key = hashlib.sha256()
    # every C file next to it: the source includes the others (cpu_kernels.c is one translation unit)
    parts = sorted(p for p in source.parent.iterdir() if p.suffix in (".c", ".h"))
    for part in (
        *(path.name.encode() + path.read_bytes() for path in parts),
        " ".join(flags + _LIBS).encode(),
        _cpu_signature().encode(),
        compiler.encode(),
    ):
        key.update(part)
    label = "+".join([tier.flag_name, *extensions])
    target = _cache_dir() / f"{name}-{label}-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _compile(source, target, compiler, flags)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
        logger.warning("could not build the %s kernel (%s): torch fallback in use", name, detail)
        return None


def load_cpu_isa_library(cpu_isa: str) -> ctypes.CDLL | None:
    """The kernel library of a ``--cpu-isa`` name other than auto, extensions included ("avx2+avx_vnni"): for
    benchmarks that compare libraries side by side."""
    tier = IsaTier[cpu_isa_tier_name(cpu_isa).upper()]
    return load_kernel_library("cpu_kernels", tier, cpu_isa_extensions(cpu_isa))


def extension_builds() -> list[tuple[IsaTier, tuple[str, ...]]]:
    """(tier, extensions) of each lower tier's library with instructions this CPU has above it whose bodies this
    CPU's own library does not run: so the tests run, here, the kernels other CPUs build natively (AVX-VNNI's
    256-bit VNNI GEMM of Intel's client cores; AVX512-VNNI's 512-bit one of Cascade Lake / Ice Lake, only above an
    AMX tier: at avx512_bf16 the native library runs that body itself)."""
    native, flags = native_tier(), cpu_info()[1]
    return [
        (tier, (name,))
        for name, (tier, _) in EXTENSION_FLAGS.items()
        if is_x86_64() and name in flags and tier < native and not (name == "avx512_vnni" and native < IsaTier.AMX)
    ]


def build_every_tier() -> list[IsaTier]:
    """Builds (or finds in the cache) the kernel library of every tier this CPU runs, the compilers side by side;
    returns the tiers whose library loaded. scripts/setup.sh runs it once, so that the processes a server or the
    tests start find every library built instead of compiling the same one at the same time (11 s of gcc for the
    native tier on an AMD EPYC here, 33 s for all four)."""
    builds: list[tuple[IsaTier, tuple[str, ...]]] = [(tier, ()) for tier in IsaTier if tier <= native_tier()]
    builds += extension_builds()
    with ThreadPoolExecutor(max_workers=len(builds)) as pool:  # each build is a gcc process: threads suffice
        libraries = list(pool.map(lambda build: load_kernel_library("cpu_kernels", *build), builds))
    return [
        tier for (tier, extensions), lib in zip(builds, libraries, strict=True) if lib is not None and not extensions
    ]


if __name__ == "__main__":
    built = build_every_tier()
    print(f"Folio's CPU kernels built for: {', '.join(tier.flag_name for tier in built) or 'no tier'}")
