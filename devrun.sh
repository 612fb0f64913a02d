#!/usr/bin/env bash
# untracked helper for device calls: step NAME 'cmd'
set -u
export REVIVA_GIT_SHA="$(cat .sha 2>/dev/null || echo unknown)"
mkdir -p "$OUT/logs"
step() {
  local name="$1"; shift
  local t0=$SECONDS
  echo "=== $name"
  bash -c "$*" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/logs/times.txt"
  tail -n 25 "$OUT/logs/$name.log"
}
