#!/usr/bin/env sh
# Set up warmspec in ./.venv: an optimized BLAS where the system can give one, then the package.
#   ./install.sh          the daemon and CLI
#   ./install.sh --test   plus the test extras (pytest, openai and anthropic SDKs, headless Neovim, aider)
set -eu
cd "$(dirname "$0")"
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"

# apt_install PACKAGE WHY: install a Debian/Ubuntu package if apt-get is there, else say why it matters.
apt_install() {
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "install.sh: install $1 with your package manager ($2)" >&2
    return 0
  fi
  SUDO=""; [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1 && SUDO=sudo
  $SUDO apt-get install -y -q "$1" >/dev/null 2>&1 ||
    { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q "$1" >/dev/null; } ||
    echo "install.sh: could not install $1 ($2)" >&2
}

# MLX's Linux CPU wheel bundles the reference BLAS (~30x slower on matmul); warmspec preloads the
# system OpenBLAS when it finds one.
if [ "$(uname -s)" = Linux ] && ! ls /usr/lib/*/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
  apt_install libopenblas0-pthread "without it warmspec runs on MLX's slow bundled BLAS"
fi
# The editor-client tests drive a real headless Neovim.
if [ -n "$extras" ] && ! command -v nvim >/dev/null 2>&1; then
  apt_install neovim "the Neovim client tests need it"
fi

# The agent tests drive aider (PyPI), whose exactly pinned dependencies (numpy, openai, tokenizers...)
# clash with ours: it gets a virtual environment of its own.
if [ -n "$extras" ] && [ ! -x .venv-aider/bin/aider ]; then
  { [ -x .venv-aider/bin/python ] || python3 -m venv .venv-aider; } &&
    .venv-aider/bin/python -m pip install -q --disable-pip-version-check "aider-chat==0.86.2" ||
    echo "install.sh: could not install aider into .venv-aider (tests/test_agents.py needs it)" >&2
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".$extras"
echo "installed: .venv/bin/warmspec"
