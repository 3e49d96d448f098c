#!/usr/bin/env bash
# Stop the local control plane started by up.sh (only the processes it recorded).
#   tools/cluster/down.sh [--purge]   # --purge also deletes certificates and logs
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
dir="${EPD_CLUSTER_DIR:-$root/.build/cluster}"
quiet=0 purge=0
for a in "$@"; do
  case "$a" in --quiet) quiet=1 ;; --purge) purge=1 ;; *) echo "down.sh: unknown argument $a" >&2; exit 2 ;; esac
done
# The real node first (it undoes what it changed on the host), then the control plane.
if [[ $purge == 1 ]]; then "$here/node.sh" down --purge; else "$here/node.sh" down; fi
stopped=()
for name in kwok kube-scheduler kube-controller-manager kube-apiserver etcd; do
  pidfile="$dir/run/$name.pid"
  [[ -f "$pidfile" ]] || continue
  pid="$(cat "$pidfile")"
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    stopped+=("$name")
  fi
  rm -f "$pidfile"
done
rm -rf "$dir/etcd"
((purge)) && rm -rf "$dir"
((quiet)) || echo "down.sh: stopped ${stopped[*]:-nothing}"
