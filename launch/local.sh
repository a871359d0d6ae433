#!/usr/bin/env bash
# Starts N CPU processes on localhost as one multi-controller JAX run (a multi-host rehearsal).
#   launch/local.sh N [--devices_per_process=D] [--module=M] -- --config=configs/semantic_softmax.py --workdir=DIR ...
# Each process gets D fake CPU devices (default 1); process 0 hosts the coordinator.
# --module=M runs `python -m M` instead of bigpretrain.main (e.g. bigpretrain.tools.infer,
# bigpretrain.tools.semi_supervised): any command that takes the three distributed flags.
# PYTHON selects the interpreter (default python3). --dry_run prints the N commands, runs nothing.
# SIGTERM / Ctrl-C go to every process and the script waits for them all (they save first);
# when one process fails, the others are stopped, and the script exits with its status.
set -euo pipefail
usage="usage: launch/local.sh N [--devices_per_process=D] -- MAIN_ARGS..."
n=${1:?$usage}; shift
[[ $n =~ ^[1-9][0-9]*$ ]] || { echo "N=$n must be a positive integer; $usage" >&2; exit 2; }
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
[[ $devices =~ ^[1-9][0-9]*$ ]] || {
  echo "--devices_per_process=$devices must be a positive integer; $usage" >&2; exit 2; }
[[ ${1:-} == "--" ]] && shift
port=${BIGPRETRAIN_PORT:-$((20000 + RANDOM % 20000))}
pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null || true' TERM
trap 'kill -INT "${pids[@]}" 2>/dev/null || true' INT
for ((i = 0; i < n; i++)); do
  # The device count last: XLA keeps a repeated flag's last value.
  cmd=(env "XLA_FLAGS=${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$devices"
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
running=("${pids[@]}")
while ((${#running[@]})); do
  done_pid=""
  wait -n -p done_pid "${running[@]}" && rc=0 || rc=$?
  [[ -z ${done_pid:-} ]] && continue  # A signal interrupted the wait: the processes go on saving.
  for i in "${!running[@]}"; do [[ ${running[i]} == "$done_pid" ]] && unset 'running[i]'; done
  if ((rc != 0 && status == 0)); then
    status=$rc
    echo "local.sh: process with pid $done_pid exited with status $rc; stopping the others." >&2
    kill -TERM "${pids[@]}" 2>/dev/null || true
    # Their peer is gone: a save needs all processes, so give them a moment, then stop them.
    (sleep 20; kill -KILL "${pids[@]}") >/dev/null 2>&1 &
    killer=$!
  fi
done
[[ -n ${killer:-} ]] && kill "$killer" 2>/dev/null
exit $status
