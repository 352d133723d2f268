#!/usr/bin/env sh
# Set up warmspec in ./.venv: an optimized BLAS where the system can give one, then the package.
#   ./install.sh          the daemon and CLI
#   ./install.sh --test   plus the test extras (pytest, openai and anthropic SDKs, ...)
set -eu
cd "$(dirname "$0")"
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"

# MLX's Linux CPU wheel bundles the reference BLAS (~30x slower on matmul); warmspec preloads the
# system OpenBLAS when it finds one. Debian/Ubuntu package: libopenblas0-pthread.
if [ "$(uname -s)" = Linux ] && ! ls /usr/lib/*/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1 && SUDO=sudo
    $SUDO apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 ||
      { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q libopenblas0-pthread >/dev/null; } ||
      echo "install.sh: could not install OpenBLAS; warmspec will run on MLX's slow bundled BLAS" >&2
  else
    echo "install.sh: install OpenBLAS with your package manager for full CPU speed" >&2
  fi
fi

# The editor-client tests drive a real headless Neovim (Debian/Ubuntu package: neovim).
if [ -n "$extras" ] && ! command -v nvim >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1 && SUDO=sudo
    $SUDO apt-get install -y -q neovim >/dev/null 2>&1 ||
      { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q neovim >/dev/null; } ||
      echo "install.sh: could not install neovim; the Neovim client tests will fail" >&2
  else
    echo "install.sh: install neovim for the editor-client tests" >&2
  fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".$extras"
echo "installed: .venv/bin/warmspec"
