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
#   --num_slices=N           Multislice: N slices of the accelerator type, created as one queued
#                            resource (nodes NAME-0 ... NAME-(N-1)), waited for until ACTIVE;
#                            the TPU runtime joins them over the data-center network and the
#                            trainer's data axis spans them
#   --spot                   create Spot VMs; a preempted run resumes from --workdir when relaunched
#   --repo=URL [--branch=B]  git clone URL (branch B) on the workers instead of copying this
#                            checkout's committed HEAD (git archive: uncommitted edits stay here)
#   --remote_dir=D           code folder in the workers' home, replaced at each launch
#                            (default bigpretrain)
#   --module=M               python -m M instead of bigpretrain.main
#   --dry_run                print the commands, run nothing
# The workers run detached (nohup): Ctrl-C stops the log stream, not the training; the script
# exits with the training's exit status. workdir and data_dir must be shared storage, since
# every host reads and writes them: data_dir a gs:// path (tfds reads it), the workdir a gs://
# path that each worker mounts with gcsfuse at /gcs/BUCKET (installed if missing, as Cloud
# Storage FUSE's docs do it) and the run gets as --workdir=/gcs/BUCKET/PATH, or a path of
# storage the workers already share. JAX finds the slice's hosts itself
# (bigpretrain.runtime.distributed). A Spot slice found PREEMPTED or TERMINATED (a queued
# resource: SUSPENDED or FAILED) is deleted and created again (a Spot VM cannot be restarted).
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
module=bigpretrain.main dry_run=0 num_slices=1
while [[ $# -gt 0 && $1 != "--" ]]; do
  case $1 in
    --name=*) name=${1#*=} ;;
    --zone=*) zone=${1#*=} ;;
    --accelerator_type=*) accelerator=${1#*=} ;;
    --version=*) version=${1#*=} ;;
    --project=*) project=${1#*=} ;;
    --num_slices=*) num_slices=${1#*=} ;;
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
[[ $num_slices =~ ^[1-9][0-9]*$ ]] || die "--num_slices must be an integer >= 1, got '$num_slices'"
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
if ((num_slices == 1)); then
  nodes=("$name")
  create=("${tpu[@]}" create "$name" "${where[@]}" "--accelerator-type=$accelerator"
          "--version=$version")
  describe=("${tpu[@]}" describe "$name" "${where[@]}" "--format=value(state)")
  delete=("${tpu[@]}" delete "$name" "${where[@]}" --quiet)
  gone="PREEMPTED TERMINATED"
else  # Multislice needs a queued resource; its nodes are NAME-0, NAME-1, ...
  nodes=()
  for ((i = 0; i < num_slices; i++)); do nodes+=("$name-$i"); done
  queued=(gcloud compute tpus queued-resources)
  create=("${queued[@]}" create "$name" "${where[@]}" "--accelerator-type=$accelerator"
          "--runtime-version=$version" "--node-count=$num_slices" "--node-prefix=$name")
  describe=("${queued[@]}" describe "$name" "${where[@]}" "--format=value(state.state)")
  delete=("${queued[@]}" delete "$name" "${where[@]}" --force --quiet)
  gone="SUSPENDED FAILED"
fi
((spot)) && create+=(--spot)

# The workdir gs://BUCKET/PATH: mounted on every worker, the run given its mounted path.
args=() mount=""
for arg in "$@"; do
  if [[ $arg == --workdir=gs://* ]]; then
    path=${arg#--workdir=gs://} bucket=${path%%/*}
    [[ -n $bucket ]] || die "--workdir=gs:// names no bucket"
    arg="--workdir=/gcs/$path"
    apt="echo \"deb https://packages.cloud.google.com/apt gcsfuse-\$(lsb_release -c -s) main\""
    apt+=" | sudo tee /etc/apt/sources.list.d/gcsfuse.list && curl -fsSL"
    apt+=" https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo tee"
    apt+=" /etc/apt/trusted.gpg.d/gcsfuse.asc > /dev/null && sudo apt-get update -q"
    apt+=" && sudo apt-get install -y -q gcsfuse"
    mount="(command -v gcsfuse > /dev/null || ($apt)) && sudo mkdir -p /gcs/$bucket"
    mount+=" && sudo chown \$(id -u):\$(id -g) /gcs/$bucket && (mountpoint -q /gcs/$bucket"
    mount+=" || gcsfuse --implicit-dirs $bucket /gcs/$bucket) && "
  fi
  args+=("$arg")
done
set -- "${args[@]}"

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
  steps=("$(show git -C "$root" archive --format=tar.gz "--output=$archive" HEAD)")
  fetch="rm -rf \$HOME/$remote_dir && mkdir -p \$HOME/$remote_dir && tar -xzf \$HOME/bigpretrain.tar.gz -C \$HOME/$remote_dir && $install"
fi
rc="\$HOME/bigpretrain_run.rc"  # The training's exit status, read after the stream.
run="${mount}cd \$HOME/$remote_dir && rm -f $rc && nohup sh -c '\"\$@\"; echo \$? > $rc' sh"
run+=" python3 -m $module $(show "$@") > $log 2>&1 < /dev/null & echo \$! > $pid"
stream="tail -n +1 -F --pid=\$(cat $pid) $log; exit \$(cat $rc 2>/dev/null || echo 1)"
for node in "${nodes[@]}"; do
  if [[ -z $repo ]]; then
    steps+=("$(show "${tpu[@]}" scp "$archive" "$node:bigpretrain.tar.gz" "${where[@]}" --worker=all)")
  fi
  steps+=("$(show "${tpu[@]}" ssh "$node" "${where[@]}" --worker=all "--command=$fetch")")
done
for node in "${nodes[@]}"; do
  steps+=("$(show "${tpu[@]}" ssh "$node" "${where[@]}" --worker=all "--command=$run")")
done
steps+=("$(show "${tpu[@]}" ssh "${nodes[0]}" "${where[@]}" --worker=0 "--command=$stream")")

if ((dry_run)); then
  echo "$(show "${describe[@]}") || $(show "${create[@]}")"
  printf '%s\n' "${steps[@]}"
  exit 0
fi
exists=1
state=$("${describe[@]}" 2> /dev/null) || exists=0
if ((exists)) && [[ " $gone " == *" $state "* ]]; then
  echo "TPU $name in $zone is $state: deleting it to create it again" >&2
  "${delete[@]}"
  exists=0
fi
if ((!exists)); then
  echo "creating TPU $name ($num_slices x $accelerator, $version) in $zone" >&2
  "${create[@]}"
  if ((num_slices > 1)); then state=$("${describe[@]}"); fi
else
  echo "reusing TPU $name in $zone ($state)" >&2
fi
while ((num_slices > 1)) && [[ $state != ACTIVE ]]; do  # A queued resource waits for capacity.
  [[ " $gone " != *" $state "* ]] || die "queued resource $name is $state"
  echo "waiting for queued resource $name ($state)" >&2
  sleep "${BIGPRETRAIN_POLL_SECONDS:-30}"
  state=$("${describe[@]}")
done
for step in "${steps[@]}"; do
  echo "+ $step" >&2
  eval "$step"
done
