#!/usr/bin/env bash
# Trains on a Cloud TPU VM slice: creates it unless it exists, puts the code on every worker,
# installs it, starts the same command on all workers, and streams worker 0's log.
#   launch/tpu_pod.sh --name=NAME --zone=ZONE --accelerator_type=v5p-64 [options] -- \
#     --config=configs/semantic_softmax.py:dataset=imagenet21k_p,data_dir=gs://B/data --workdir=gs://B/runs/ss
# Options:
#   --name=NAME --zone=ZONE  the TPU VM (required)
#   --accelerator_type=T     v4-32, v5p-64, v5litepod-64, v6e-64, ... (required; used to create)
#   --version=V              TPU software version; default per generation, as Cloud TPU's docs
#                            advise for JAX: tpu-ubuntu2204-base (v4 and older), v2-alpha-tpuv5
#                            (v5p), v2-alpha-tpuv5-lite (v5e), v2-alpha-tpuv6e (v6e)
#   --project=P              gcloud project (default: gcloud's configured one)
#   --spot                   create Spot VMs; a preempted run resumes from --workdir when relaunched
#   --repo=URL [--branch=B]  git clone URL (branch B) on the workers instead of copying this
#                            checkout's committed HEAD (git archive: uncommitted edits stay here)
#   --remote_dir=D           code folder in the workers' home, replaced at each launch
#                            (default bigpretrain)
#   --module=M               python -m M instead of bigpretrain.main
#   --dry_run                print the commands, run nothing
# The workers run detached (nohup): Ctrl-C stops the log stream, not the training. workdir and
# data_dir must be shared storage (GCS), since every host reads and writes them. JAX finds the
# slice's hosts itself (bigpretrain.runtime.distributed).
set -euo pipefail

die() { echo "tpu_pod.sh: $*" >&2; exit 2; }

# Prints its arguments as one shell line, quoting only the words that need it.
show() {
  local out=() word
  for word in "$@"; do
    if [[ $word =~ ^[A-Za-z0-9_./:=@,+%-]+$ ]]; then
      out+=("$word")
    else
      out+=("'${word//\'/\'\\\'\'}'")
    fi
  done
  echo "${out[*]}"
}

name="" zone="" accelerator="" version="" project="" spot=0 repo="" branch="" remote_dir=bigpretrain
module=bigpretrain.main dry_run=0
while [[ $# -gt 0 && $1 != "--" ]]; do
  case $1 in
    --name=*) name=${1#*=} ;;
    --zone=*) zone=${1#*=} ;;
    --accelerator_type=*) accelerator=${1#*=} ;;
    --version=*) version=${1#*=} ;;
    --project=*) project=${1#*=} ;;
    --spot) spot=1 ;;
    --repo=*) repo=${1#*=} ;;
    --branch=*) branch=${1#*=} ;;
    --remote_dir=*) remote_dir=${1#*=} ;;
    --module=*) module=${1#*=} ;;
    --dry_run) dry_run=1 ;;
    *) die "unknown option $1 (launcher options come before --, training flags after it)" ;;
  esac
  shift
done
[[ ${1:-} == "--" ]] && shift
[[ -n $name ]] || die "--name is required (the TPU VM to create or reuse)"
[[ -n $zone ]] || die "--zone is required"
[[ -n $accelerator ]] || die "--accelerator_type is required (e.g. v5p-64)"
[[ -z $branch || -n $repo ]] || die "--branch needs --repo"
[[ $remote_dir =~ ^[A-Za-z0-9_.-]+$ ]] || die "--remote_dir must be a plain folder name, got '$remote_dir'"
[[ " $* " == *" --config="* ]] || die "the training flags after -- need --config=..."
[[ " $* " == *" --workdir="* ]] || die "the training flags after -- need --workdir=... (shared storage, e.g. gs://...)"
if [[ -z $version ]]; then
  case $accelerator in
    v6e-*) version=v2-alpha-tpuv6e ;;
    v5p-*) version=v2-alpha-tpuv5 ;;
    v5litepod-*) version=v2-alpha-tpuv5-lite ;;
    v2-* | v3-* | v4-*) version="tpu-ubuntu2204-base" ;;
    *) die "no default --version for accelerator type '$accelerator': pass --version" ;;
  esac
fi

tpu=(gcloud compute tpus tpu-vm)
where=("--zone=$zone")
[[ -n $project ]] && where+=("--project=$project")
create=("${tpu[@]}" create "$name" "${where[@]}" "--accelerator-type=$accelerator" "--version=$version")
((spot)) && create+=(--spot)
describe=("${tpu[@]}" describe "$name" "${where[@]}" "--format=value(state)")

log="\$HOME/bigpretrain_run.log" pid="\$HOME/bigpretrain_run.pid"  # expanded on the workers
install="python3 -m pip install -q -e \$HOME/$remote_dir 'jax[tpu]'"
if [[ -n $repo ]]; then
  clone=(git clone --depth=1)
  [[ -n $branch ]] && clone+=("--branch=$branch")
  clone+=("$repo")
  fetch="rm -rf \$HOME/$remote_dir && $(show "${clone[@]}") \$HOME/$remote_dir && $install"
  steps=()
else
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  archive=${TMPDIR:-/tmp}/bigpretrain_$name.tar.gz
  steps=(
    "$(show git -C "$root" archive --format=tar.gz "--output=$archive" HEAD)"
    "$(show "${tpu[@]}" scp "$archive" "$name:bigpretrain.tar.gz" "${where[@]}" --worker=all)"
  )
  fetch="rm -rf \$HOME/$remote_dir && mkdir -p \$HOME/$remote_dir && tar -xzf \$HOME/bigpretrain.tar.gz -C \$HOME/$remote_dir && $install"
fi
run="cd \$HOME/$remote_dir && nohup python3 -m $module $(show "$@") > $log 2>&1 < /dev/null & echo \$! > $pid"
stream="tail -n +1 -F --pid=\$(cat $pid) $log"
steps+=(
  "$(show "${tpu[@]}" ssh "$name" "${where[@]}" --worker=all "--command=$fetch")"
  "$(show "${tpu[@]}" ssh "$name" "${where[@]}" --worker=all "--command=$run")"
  "$(show "${tpu[@]}" ssh "$name" "${where[@]}" --worker=0 "--command=$stream")"
)

if ((dry_run)); then
  echo "$(show "${describe[@]}") || $(show "${create[@]}")"
  printf '%s\n' "${steps[@]}"
  exit 0
fi
if ! "${describe[@]}" > /dev/null 2>&1; then
  echo "creating TPU VM $name ($accelerator, $version) in $zone" >&2
  "${create[@]}"
else
  echo "reusing TPU VM $name in $zone" >&2
fi
for step in "${steps[@]}"; do
  echo "+ $step" >&2
  eval "$step"
done
