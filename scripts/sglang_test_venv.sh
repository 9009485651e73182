#!/usr/bin/env bash
# Build the venv of the live SGLang test server (CPU only): .venv-sglang/ by default, or $AGENTFLOW_SGLANG_VENV.
#   scripts/sglang_test_venv.sh          build it, or only check it when it is already built
#   scripts/sglang_test_venv.sh --force  rebuild it from scratch
# SGLang gets a venv of its own: its pins (transformers, openai, ...) differ from the project's. Everything comes
# from the package registry by name (~6 min on 2 cores). Two small adaptations make the registry's builds run on a
# CPU-only machine (scripts/sglang_cpu/): a torchvision schema shim loaded by a .pth file, and a CPU stand-in for
# sgl_kernel that the test server puts on its PYTHONPATH. A stamp file records what was built; a second run whose
# stamp matches only checks that sglang imports.
set -euo pipefail
cd "$(dirname "$0")/.."

SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0
VENV=${AGENTFLOW_SGLANG_VENV:-.venv-sglang}
HERE=scripts/sglang_cpu
PY=${PYTHON:-python3}

stamp() {  # what the venv was built from: the versions and the adaptation files
  { echo "sglang=$SGLANG_VERSION torch=$TORCH_VERSION torchvision=$TORCHVISION_VERSION"
    cat "$HERE/requirements.txt" "$HERE/torchvision_cpu.py" "$HERE/sgl_kernel/__init__.py"; } | sha256sum | cut -c1-16
}

check() {
  SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$VENV/cpu_stubs" "$VENV/bin/python" -c "import sglang, torchvision, sgl_kernel" \
    2>/dev/null
}

want=$(stamp)
if [[ "${1:-}" != "--force" && -f "$VENV/agentflow-stamp" && "$(cat "$VENV/agentflow-stamp")" == "$want" ]]; then
  if check; then echo "sglang-venv: ready ($VENV, sglang $SGLANG_VERSION)"; exit 0; fi
  echo "sglang-venv: $VENV is broken; rebuilding" >&2
fi

t0=$(date +%s)
rm -rf "$VENV"
"$PY" -m venv "$VENV"
pip() {  # pip's own exit status; its notes about absent local index folders are left out
  "$VENV/bin/python" -m pip "$@" 2> >(grep -v -E "^WARNING: Location|ignored: it is neither" >&2)
}
pip install -q --upgrade pip
mkdir -p "$VENV/wheels"
# the wheel alone: its own requirements name CUDA-only packages and a newer (CUDA) torch
pip download -q --no-deps "sglang==$SGLANG_VERSION" -d "$VENV/wheels"
# torch pinned in the same command as everything that depends on it (an unpinned torch pulls CUDA wheels)
pip install -q "torch==$TORCH_VERSION" -r "$HERE/requirements.txt"
pip install -q --no-deps "$VENV"/wheels/sglang-"$SGLANG_VERSION"-*.whl "torchvision==$TORCHVISION_VERSION"
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp "$HERE/torchvision_cpu.py" "$site/agentflow_torchvision_cpu.py"
echo "import agentflow_torchvision_cpu" > "$site/agentflow_torchvision_cpu.pth"
mkdir -p "$VENV/cpu_stubs" && cp -r "$HERE/sgl_kernel" "$VENV/cpu_stubs/"
rm -rf "$VENV/wheels"
check || { echo "sglang-venv: sglang does not import in $VENV" >&2; exit 1; }
echo "$want" > "$VENV/agentflow-stamp"
echo "sglang-venv: built $VENV (sglang $SGLANG_VERSION, torch $TORCH_VERSION) in $(( $(date +%s) - t0 )) s"
