#!/usr/bin/env bash
# Installs the official OpenAI and Anthropic Python SDKs, for the conformance test.
# Used by: tests/sdk.rs, docs/dev/testing.md and .ci/run
# Usage: bench/scripts/install-sdks.sh [VENV]   (default bench/.venv-sdk, git-ignored). Idempotent.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"

VENV=${1:-bench/.venv-sdk}
PKGS=(openai==3.63.0 anthropic==2.17.0)

if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
  [ "$(id -u)" -eq 0 ] || die "python3 lacks venv/ensurepip; install python3-venv (as root)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "${PKGS[@]}"
"$VENV/bin/python" -c 'import openai, anthropic; print("openai", openai.__version__, "anthropic", anthropic.__version__)'
