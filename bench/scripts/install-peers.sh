#!/usr/bin/env bash
# Installs the peer routers `kvbench compare` runs beside kvroute (sglang-router, vllm-router).
# Used by: docs/results/peers.md and docs/dev/kvbench.md
#
# Installs the peer routers that `kvbench compare` runs as baselines (policy entries
# `sglang-router/...` and `vllm-router/...`) into one venv, from PyPI:
#   sglang-router 0.3.2, vllm-router 0.1.17 (binary wheels; a Rust router inside each).
# Usage: bench/scripts/install-peers.sh [VENV]   (default bench/.venv-peers, git-ignored)
# Idempotent: pinned versions already present are left alone. Prints the installed versions.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"

VENV=${1:-bench/.venv-peers}
PEERS=(sglang-router==0.3.2 vllm-router==0.1.17)

# A Python without venv or ensurepip (Debian's python3 before python3-venv is installed)
# cannot create the venv; this script runs as root in CI-like environments, so install it.
if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
  [ "$(id -u)" -eq 0 ] || die "python3 lacks venv/ensurepip; install python3-venv (as root)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
fi

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi

# pip exits early when the pinned versions are already satisfied, so a rerun downloads nothing.
"$VENV/bin/python" -m pip install --disable-pip-version-check -q "${PEERS[@]}"

"$VENV/bin/python" - <<'EOF'
from importlib.metadata import version
for name in ("sglang-router", "vllm-router"):
    print(f"{name} {version(name)}")
EOF
