#!/usr/bin/env bash
# untracked device helper: step NAME LIMIT 'cmd'
export REVIVA_GIT_SHA="$(cat .sha)"
R=/tmp/rv; mkdir -p $R/logs
finish() { cp -f $R/*.json "$OUT"/ 2>/dev/null; cp -f $R/*.log $R/logs/ 2>/dev/null; tar czf "$OUT/logs.tgz" -C $R logs 2>/dev/null; }
step() { local name="$1" limit="$2"; shift 2; echo "=== $name ($(date +%T))"; local t0=$SECONDS
  timeout "$limit" bash -c "$*" > "$R/logs/$name.log" 2>&1; local rc=$?
  echo "--- $name rc=$rc $((SECONDS-t0)) s"; tail -n 25 "$R/logs/$name.log"; finish; }
