#!/usr/bin/env bash
# Runs the same command on every worker of a Cloud TPU VM slice; JAX finds the pod itself.
#   launch/tpu_pod.sh TPU_NAME ZONE -- --config=configs/semantic_softmax.py:dataset=imagenet21k_p,data_dir=gs://... --workdir=gs://...
# The repo must be at the same path on every worker (e.g. cloned by a startup script), and
# workdir/data_dir must be shared storage (GCS), since every host reads and writes them.
set -euo pipefail
tpu=${1:?TPU name}; zone=${2:?zone}; shift 2
[[ ${1:-} == "--" ]] && shift
repo=${BIGPRETRAIN_REMOTE_DIR:-bigpretrain}
args=$(printf '%q ' "$@")
gcloud compute tpus tpu-vm ssh "$tpu" --zone="$zone" --worker=all --command \
  "cd $repo && pip install -q -e . 'jax[tpu]' && python -m bigpretrain.main $args"
