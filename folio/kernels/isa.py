"""CPU instruction-set tiers: what this CPU can run, what a user asked for, and the compiler flags of each.

A tier is a rung of x86-64 vector support that Folio's C kernels have bodies for. The kernels never guess the
CPU at run time: each library is compiled for one tier (``compile_flags``) and reports the tier it was built for
(``folio_isa_tier`` in cpu_kernels.c), and the engine chooses each operation's implementation from that
(folio/kernels/cpu_plan.py). ``--cpu-isa`` forces a lower tier, for tests, benchmarks and mixed fleets.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import platform
from pathlib import Path


class IsaTier(enum.IntEnum):
    """Ordered: a CPU that runs a tier runs every lower one."""

    GENERIC = 0  # no SIMD assumed: plain C (other architectures, old x86-64)
    AVX2 = 1  # x86-64-v3: AVX2 + FMA + F16C (Haswell, Zen 1-3)
    AVX512 = 2  # x86-64-v4: AVX-512 F/BW/CD/DQ/VL (Skylake-SP, Cascade Lake)
    AVX512_BF16 = 3  # x86-64-v4 + AVX512-BF16 (Cooper Lake, Zen 4/5)
    AMX = 4  # AVX512_BF16 + AMX-TILE + AMX-BF16 (Sapphire Rapids and later), with the OS's leave to use the tiles

    @property
    def flag_name(self) -> str:
        """The name ``--cpu-isa`` takes: generic, avx2, avx512, avx512_bf16, amx."""
        return self.name.lower()


# The /proc/cpuinfo flags each tier needs on top of the tier below (gcc's x86-64-v3 / v4 definitions).
_REQUIRED_FLAGS: dict[IsaTier, tuple[str, ...]] = {
    IsaTier.GENERIC: (),
    IsaTier.AVX2: ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"),
    IsaTier.AVX512: ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
    IsaTier.AVX512_BF16: ("avx512_bf16",),
    IsaTier.AMX: ("amx_tile", "amx_bf16"),
}
# gcc flags of each tier when it is not this CPU's own (the CPU's own tier builds with -march=native)
_MARCH: dict[IsaTier, list[str]] = {
    IsaTier.GENERIC: ["-march=x86-64"],
    IsaTier.AVX2: ["-march=x86-64-v3"],
    IsaTier.AVX512: ["-march=x86-64-v4"],
    IsaTier.AVX512_BF16: ["-march=x86-64-v4", "-mavx512bf16"],
    IsaTier.AMX: ["-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
}
# Instructions a library of a lower tier may add where this CPU has them (/proc/cpuinfo flag -> (the tier it is
# offered at, gcc flag)), so that tests and benchmarks run a body that only some CPUs of that tier have (AVX-VNNI at
# the avx2 tier: Intel's client cores since Alder Lake, whose own tier is avx2; AVX512-VNNI at the avx512 tier:
# Cascade Lake and Ice Lake) on a CPU whose own tier is higher: ``--cpu-isa avx2+avx_vnni``. A CPU's own tier needs
# none: it builds with -march=native, which has them all.
EXTENSION_FLAGS: dict[str, tuple[IsaTier, str]] = {
    "avx_vnni": (IsaTier.AVX2, "-mavxvnni"),
    "avx512_vnni": (IsaTier.AVX512, "-mavx512vnni"),  # Cascade Lake, Ice Lake: their own tier is avx512
}
CPU_ISA_CHOICES = (
    "auto",
    *(tier.flag_name for tier in IsaTier),
    *(f"{tier.flag_name}+{name}" for name, (tier, _) in EXTENSION_FLAGS.items()),
)


@functools.cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """(model name, feature flags) of this CPU from /proc/cpuinfo; flags are empty where it cannot be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine(), frozenset()
    fields: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = frozenset(fields.get("flags", "").split())
    if flags >= _AMX_FLAGS and not request_amx_permission():
        flags -= _AMX_FLAGS  # the CPU has the tiles but the kernel lends them to no process: not a usable tier
    return fields.get("model name", platform.machine()), flags


_AMX_FLAGS = frozenset(_REQUIRED_FLAGS[IsaTier.AMX])
_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158


def request_amx_permission() -> bool:
    """Asks Linux (5.16+) for this process's leave to use the AMX tile registers, which it grants per process and
    which every process that runs an AMX kernel must ask for (execution faults otherwise); True when granted."""
    if not is_x86_64() or platform.system() != "Linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return False


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def detect_tier(flags: frozenset[str], x86_64: bool = True) -> IsaTier:
    """The highest tier whose flags (and every lower tier's) the CPU has; GENERIC off x86-64."""
    if not x86_64:
        return IsaTier.GENERIC
    best = IsaTier.GENERIC
    for tier in IsaTier:
        if not all(flag in flags for flag in _REQUIRED_FLAGS[tier]):
            break
        best = tier
    return best


def cpu_isa_tier_name(requested: str) -> str:
    """The tier ``--cpu-isa`` names before its extensions ("avx2+avx_vnni" -> "avx2")."""
    return requested.split("+")[0]


def cpu_isa_extensions(requested: str) -> tuple[str, ...]:
    """The extensions ``--cpu-isa`` names after its tier ("avx2+avx_vnni" -> ("avx_vnni",))."""
    return tuple(requested.split("+")[1:])


def resolve_cpu_isa(requested: str, flags: frozenset[str], x86_64: bool = True) -> IsaTier:
    """``--cpu-isa`` -> the tier to build for: "auto" is the CPU's best; a named tier must not exceed it, and the
    extensions it names (``cpu_isa_extensions``) must be this CPU's.

    Raises ValueError naming the flag, the choices, and what this CPU lacks.
    """
    native = detect_tier(flags, x86_64)
    if requested == "auto":
        return native
    if requested not in CPU_ISA_CHOICES:
        raise ValueError(f"cpu_isa must be one of {', '.join(CPU_ISA_CHOICES)}; got {requested!r}")
    tier = IsaTier[cpu_isa_tier_name(requested).upper()]
    if tier > native:
        missing = sorted({f for t in IsaTier if t <= tier for f in _REQUIRED_FLAGS[t]} - flags)
        raise ValueError(
            f"--cpu-isa {requested}: this CPU's best tier is {native.flag_name}; it lacks "
            f"{', '.join(missing) if missing else 'x86-64'} (CPU flags: {' '.join(sorted(flags)) or 'unknown'})"
        )
    try:
        check_extensions(tier, cpu_isa_extensions(requested), flags)
    except ValueError as exc:
        raise ValueError(f"--cpu-isa {requested}: {exc}") from None
    return tier


def compile_flags(tier: IsaTier, native: IsaTier, x86_64: bool = True, extensions: tuple[str, ...] = ()) -> list[str]:
    """gcc's target flags for a library of ``tier`` on a CPU whose own tier is ``native``, with ``extensions``
    (``EXTENSION_FLAGS``' names, which the caller checked this CPU has).

    The CPU's own tier builds with -march=native (its exact tuning and any extra instructions, e.g. AVX512-VNNI);
    a lower tier builds for the generic x86-64 level, so it contains no instruction above that level and runs on
    any CPU of the tier, tuned for this one, plus the extensions asked for.
    """
    if not x86_64:
        return []  # generic C for the compiler's default target (aarch64 and others)
    if tier == native:
        return ["-march=native"]
    return [*_MARCH[tier], *(EXTENSION_FLAGS[name][1] for name in extensions), "-mtune=native"]


def check_extensions(tier: IsaTier, extensions: tuple[str, ...], flags: frozenset[str]) -> None:
    """Raises ValueError unless each of ``extensions`` is known, this CPU has it, and ``tier`` can carry it."""
    for name in extensions:
        if name not in EXTENSION_FLAGS:
            raise ValueError(f"unknown kernel extension {name!r}; known: {', '.join(EXTENSION_FLAGS)}")
        lowest, _ = EXTENSION_FLAGS[name]
        if name not in flags:
            raise ValueError(f"kernel extension {name}: this CPU lacks it (CPU flags: {' '.join(sorted(flags))})")
        if tier < lowest:
            raise ValueError(
                f"kernel extension {name} needs the {lowest.flag_name} tier or above, not {tier.flag_name}"
            )


# What each tier allows torch's own libraries (MKL, oneDNN, ATen's vectorised ops), by their environment variables.
_LIBRARY_ISA: dict[IsaTier, dict[str, str]] = {
    IsaTier.GENERIC: {
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "ATEN_CPU_CAPABILITY": "default",
    },
    IsaTier.AVX2: {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    IsaTier.AVX512: {
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "ATEN_CPU_CAPABILITY": "avx512",
    },
    IsaTier.AVX512_BF16: {  # MKL's AVX512_E3: AVX-512 with VNNI and bfloat16, no AMX (E4)
        "MKL_ENABLE_INSTRUCTIONS": "AVX512_E3",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
        "ATEN_CPU_CAPABILITY": "avx512",
    },
}


def library_isa_env(tier: IsaTier, native: IsaTier) -> dict[str, str]:
    """The environment that holds MKL, oneDNN and ATen to ``tier`` on a CPU whose own tier is ``native`` (empty
    when they are equal): a process started with ``--cpu-isa avx2`` on an AVX-512 machine then runs every library
    as an AVX2 machine would, not only Folio's kernels, so its figures stand for that tier. The libraries read it
    once, when first used: the CLI sets it at process start, before any of them runs."""
    return {} if tier >= native else dict(_LIBRARY_ISA[tier])
