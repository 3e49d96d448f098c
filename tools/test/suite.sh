#!/usr/bin/env bash
# `make test`: the Kubernetes tests (tests/k8s) in a second pytest beside the rest.
#
# Why: the rest is CPU-bound (each engine test starts routers and engine processes), while the
# Kubernetes tests mostly wait on the API server, controllers and kwok (about a fifth of a
# core measured). Side by side the suite takes about the longer of the two, not their sum.
# EPD_TEST_SERIAL=1 runs them one after the other in one pytest, as before.
#
# usage: tools/test/suite.sh PYTHON [pytest options...]   (options apply to both runs)
set -uo pipefail
py=$1
shift
names_tests=0  # a selection by path (tests/engine/..., a::test) runs as given, in one pytest
for arg in "$@"; do [[ $arg != -* && -e ${arg%%::*} ]] && names_tests=1; done
if [[ ${EPD_TEST_SERIAL:-0} == 1 || $names_tests == 1 ]]; then
  exec "$py" -m pytest "$@"
fi
mkdir -p .build
k8s_log=.build/test-k8s.log
"$py" -m pytest tests/k8s "$@" >"$k8s_log" 2>&1 &
k8s_pid=$!
trap 'kill "$k8s_pid" 2>/dev/null; wait "$k8s_pid" 2>/dev/null' INT TERM
echo "suite: tests/k8s runs beside the rest (pid $k8s_pid); its output follows at the end ($k8s_log)"
"$py" -m pytest --ignore=tests/k8s "$@"
rest=$?
wait "$k8s_pid"
k8s=$?
trap - INT TERM
echo
echo "======================== tests/k8s (ran beside the rest) ========================"
cat "$k8s_log"
echo "suite: exit codes: tests/k8s $k8s, the rest $rest"
# 5: nothing collected (a selection that names no Kubernetes test) is not a failure
((k8s == 5)) && k8s=0
((rest == 5)) && rest=0
((k8s == 0 && rest == 0))
