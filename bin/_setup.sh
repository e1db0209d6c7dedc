# Shared set-up for bin/quickstart and bin/test (sourced, not run).
# Idempotent: every step records a stamp keyed by the content of what it installs, so a second run skips it.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ASYNC_VLA_VENV:-$REPO/.venv}"
STAMPS="$VENV/.async-vla-stamps"
PY="$VENV/bin/python"

_stamp_ok() { [ -f "$STAMPS/$1" ] && [ "$(cat "$STAMPS/$1")" = "$2" ]; }
_stamp_set() { mkdir -p "$STAMPS"; echo "$2" > "$STAMPS/$1"; }

setup_native() {
  # async_vla/weights/native: copy-with-checksum kernel for packing weights (optional: torch is the fallback,
  # slower).
  local dir="$REPO/async_vla/weights/native" lib="$REPO/async_vla/weights/native/libavla_copysum.so" key
  local src=("$dir/copysum.c")
  key="$(cat "${src[@]}" | sha1sum | cut -d' ' -f1)"
  if [ -f "$lib" ] && _stamp_ok native "$key"; then return; fi
  local cc="${CC:-cc}"
  if ! command -v "$cc" >/dev/null 2>&1; then
    echo "[setup] no C compiler ($cc): weight packing falls back to torch (slower); apt-get install gcc to build it" >&2
    return
  fi
  echo "[setup] building async_vla/weights/native/$(basename "$lib")"
  if ! "$cc" -O2 -shared -fPIC -o "$lib.tmp" "${src[@]}"; then
    rm -f "$lib.tmp"
    echo "[setup] building $(basename "$lib") failed: weight packing falls back to torch (slower)" >&2
    return
  fi
  mv "$lib.tmp" "$lib"
  _stamp_set native "$key"
}

setup_venv() {
  if [ ! -x "$PY" ]; then
    echo "[setup] creating virtual environment $VENV"
    python3 -m venv "$VENV"
  fi
  setup_native
  local key
  key="$(cat "$REPO/pyproject.toml" | sha1sum | cut -d' ' -f1)-$1"
  if _stamp_ok core "$key"; then
    echo "[setup] python packages up to date ($VENV)"
    return
  fi
  echo "[setup] installing python packages into $VENV (extras: $1)"
  "$PY" -m pip install -q --upgrade pip
  if "$PY" -c "import torch" 2>/dev/null; then
    echo "[setup] torch already installed: $("$PY" -c 'import torch; print(torch.__version__)')"
  elif command -v nvidia-smi >/dev/null 2>&1 && [ -z "${ASYNC_VLA_CPU_TORCH:-}" ]; then
    # GPU hosts: the default PyPI torch (CUDA build). See README "GPU install".
    "$PY" -m pip install -q torch
  else
    # CPU machines: the CPU wheel (an unpinned torch would pull a multi-GB CUDA build).
    "$PY" -m pip install -q "torch==2.13.0"
  fi
  if [ -n "$1" ]; then "$PY" -m pip install -q -e "$REPO[$1]"; else "$PY" -m pip install -q -e "$REPO"; fi
  _stamp_set core "$key"
}

setup_test_tools() {
  # shellcheck lints the Slurm script bin/slurm renders (tests/test_slurm.py): a Debian package.
  if command -v shellcheck >/dev/null 2>&1; then return; fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] apt-get install shellcheck"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends shellcheck >/dev/null
  else
    echo "[setup] WARNING: shellcheck missing (not root or no apt-get): tests/test_slurm.py skips its lint" >&2
  fi
}

setup_libero() {
  # Real LIBERO for the libero tests and configs (bin/install-libero is idempotent itself).
  if [ -x "$REPO/bin/install-libero" ]; then
    "$REPO/bin/install-libero" "$VENV"
  fi
}
