#!/usr/bin/env bash
# Starts N CPU processes on localhost as one multi-controller JAX run (a multi-host rehearsal).
#   launch/local.sh N [--devices_per_process=D] [--module=M] -- --config=configs/semantic_softmax.py --workdir=DIR ...
# Each process gets D fake CPU devices (default 1); process 0 hosts the coordinator.
# --module=M runs `python -m M` instead of bigpretrain.main (e.g. bigpretrain.tools.infer,
# bigpretrain.tools.semi_supervised): any command that takes the three distributed flags.
# PYTHON selects the interpreter (default python3). --dry_run prints the N commands, runs nothing.
set -euo pipefail
n=${1:?usage: launch/local.sh N [--devices_per_process=D] -- MAIN_ARGS...}; shift
devices=1
module=bigpretrain.main
dry_run=0
while [[ $# -gt 0 && $1 != "--" ]]; do
  case $1 in
    --devices_per_process=*) devices=${1#*=} ;;
    --module=*) module=${1#*=} ;;
    --dry_run) dry_run=1 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
[[ ${1:-} == "--" ]] && shift
port=${BIGPRETRAIN_PORT:-$((20000 + RANDOM % 20000))}
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' INT TERM
for ((i = 0; i < n; i++)); do
  cmd=(env "XLA_FLAGS=--xla_force_host_platform_device_count=$devices ${XLA_FLAGS:-}"
       JAX_PLATFORMS=cpu "${PYTHON:-python3}" -m "$module" "$@"
       --coordinator_address="127.0.0.1:$port" --num_processes="$n" --process_id="$i")
  if ((dry_run)); then
    printf '%q ' "${cmd[@]}" | sed 's/ $//'
    echo
    continue
  fi
  "${cmd[@]}" &
  pids+=($!)
done
((dry_run)) && exit 0
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
