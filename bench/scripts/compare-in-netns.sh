#!/usr/bin/env bash
# Runs a command (normally `kvbench compare`) in a network namespace that has only loopback.
# Used by: docs/results/peers.md and docs/dev/kvbench.md
#
# Runs a command, normally `kvbench compare ...`, inside a new network namespace that has only
# a loopback interface, and deletes the namespace afterwards.
#
# Why: sglang-router tries to download a tokenizer from the internet when workers register;
# in here it cannot reach anything but 127.0.0.1, so a peer run sends no traffic off the
# machine, and its failed look-ups fail at once instead of waiting for a timeout. The whole
# run (simulated fleet, router, replay) is inside and talks over the namespace's loopback.
#
# Usage (as root, from the repository root):
#   bench/scripts/compare-in-netns.sh target/release/kvbench compare --policies kv_aware,sglang-router/cache_aware ...
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"

if [ $# -lt 1 ]; then
  sed -n '5,14p' "$0" >&2
  exit 2
fi
[ "$(id -u)" -eq 0 ] || die "creating a network namespace needs root"

NS=kvbench-$$
ip netns add "$NS"
trap 'ip netns delete "$NS" 2>/dev/null || true' EXIT
# Bash runs the EXIT trap when a signal ends it only if the signal is trapped.
trap 'exit 130' INT
trap 'exit 143' TERM
ip netns exec "$NS" ip link set lo up
ip netns exec "$NS" "$@"
