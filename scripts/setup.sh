#!/usr/bin/env bash
# Set up a fresh machine: Debian packages (when we may), a .venv with the project installed.
#   scripts/setup.sh          runtime (the demo job)
#   scripts/setup.sh --dev    runtime + test tools
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

DEV=0
[[ "${1:-}" == "--dev" ]] && DEV=1

# bubblewrap: the default sandbox; libseccomp2: the library its seccomp filter is compiled with (pyseccomp binds it).
APT_PACKAGES=(bubblewrap libseccomp2)
# --dev: the docker sandbox's tests start a private engine (dockerd, containerd, runc) from Debian's docker.io.
((DEV)) && APT_PACKAGES+=(docker.io)
# --dev: browser and desktop env tests drive the system Chromium (Playwright; its headless shell when installed)
# and Tk apps on Xvfb.
((DEV)) && APT_PACKAGES+=(chromium chromium-headless-shell xvfb)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -eq 0 ]]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO="none"; fi
  if [[ "$SUDO" == "none" ]]; then
    echo "setup: missing Debian packages; run:  sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  echo "setup: installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
extras=""
((DEV)) && extras="[dev]"
# torch is pinned in the same command as everything that depends on it: an unpinned torch pulls CUDA wheels.
.venv/bin/python -m pip install -q "torch==2.13.0" -e ".${extras}" 2>&1 | grep -v -E "^WARNING: Location|ignored: it is neither" || true
.venv/bin/python -c "import torch, megatron.core, agentflow" || { echo "setup: install failed" >&2; exit 1; }
# --dev: the `sglang` tests run a real SGLang server on CPU from a venv of its own (built once, then only checked).
((DEV)) && scripts/sglang_test_venv.sh
echo "setup: ready (.venv)"
