#!/usr/bin/env bash
# The baseline launcher: what a user writes by hand to start two local workers with TF_CONFIG.
#   bench/jobs/hand_launch.sh PORT0 PORT1 LOGDIR [CPUS0 CPUS1] -- PROGRAM ARGS...
# Both workers run in the background; exit status: the first non-zero of the two.
set -u
p0=$1 p1=$2 logs=$3; shift 3
c0="" c1=""
if [ "$1" != "--" ]; then c0=$1 c1=$2; shift 2; fi
shift  # --
mkdir -p "$logs"
cluster="{\"worker\": [\"localhost:$p0\", \"localhost:$p1\"]}"
pin() { if [ -n "$1" ]; then echo "taskset -c $1"; fi; }
export TF_USE_LEGACY_KERAS=1 PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=""
TF_CONFIG="{\"cluster\": $cluster, \"task\": {\"type\": \"worker\", \"index\": 0}}" \
    $(pin "$c0") "$@" > "$logs/worker0.log" 2>&1 &
w0=$!
TF_CONFIG="{\"cluster\": $cluster, \"task\": {\"type\": \"worker\", \"index\": 1}}" \
    $(pin "$c1") "$@" > "$logs/worker1.log" 2>&1 &
w1=$!
wait $w0; s0=$?
wait $w1; s1=$?
[ $s0 -ne 0 ] && exit $s0
exit $s1
