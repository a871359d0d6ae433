"""Kubernetes JobSet for training on GKE GPU or TPU node pools; prints it or applies it.

  python launch/gke_jobset.py --name=ss-vitb --image=IMAGE --gpu=nvidia-h100-mega-80gb \
      --num_nodes=4 [--dry_run] -- --config=configs/semantic_softmax.py:... --workdir=gs://B/runs/ss
  python launch/gke_jobset.py --name=ss-vitb --image=IMAGE --tpu=tpu-v5p-slice --topology=4x4x4 \
      [--num_slices=2] ...

One JobSet (jobset.x-k8s.io/v1alpha2) with one Indexed Job of one pod per host, each running
`python3 -m bigpretrain.main ...` from IMAGE (the package installed, plus jax[cuda12] or
jax[tpu]). GPU: a process per node owns all its GPUs; pod 0, reached at its stable name
`<name>-workers-0-0.<name>` through the JobSet's headless service, hosts the coordinator, and a
pod's completion index is its process id (BIGPRETRAIN_* variables, read by
bigpretrain.runtime.distributed). TPU: GKE gives each pod of the slice TPU_WORKER_ID and
TPU_WORKER_HOSTNAMES, from which JAX finds the slice. --num_slices=N (Multislice, multi-host
slices only): N Jobs, one slice each on its own node pool, joined over the data-center network
by the MEGASCALE_* variables (coordinator: the first pod of slice 0; JAX numbers the processes
slice by slice, and the mesh's data axis spans the slices). A preempted or deleted pod gets
SIGTERM and --grace_seconds to checkpoint; a failed pod restarts the whole JobSet (every process
must rejoin), up to --max_restarts times, resuming from --workdir. The workdir gs://B/PATH is
bucket B mounted at /gcs/B by GKE's Cloud Storage FUSE CSI driver (the cluster needs it
enabled and the pods' service account access to B), so the run gets --workdir=/gcs/B/PATH,
a path every pod reads and writes. Not set here: the GPU fabric's
NCCL plugin (GPUDirect-TCPX/TCPXO on A3 nodes), which comes with the cluster's own setup.
Without --dry_run the manifest goes to `kubectl apply -f -`.
"""
import argparse
import math
import re
import subprocess
import sys

import yaml

JOB = "workers"  # the replicated job's name, part of every pod's hostname
GCS_MOUNT = "/gcs"  # where the workdir's bucket is mounted in each pod
_TPU_2D = ("tpu-v5-lite-podslice", "tpu-v6e-slice")  # v5e, v6e: chips in a 2D torus
_TPU_3D = ("tpu-v4-podslice", "tpu-v5p-slice")  # v4, v5p: chips in a 3D torus
_TPU_CHIPS_PER_HOST = 4  # every multi-host slice of these generations has 4 chips per VM
_TPU_SINGLE_HOST_MAX = 8  # v5e/v6e slices up to 2x4 are one VM with all their chips


def tpu_hosts(accelerator: str, topology: str) -> tuple[int, int]:
  """(hosts, chips per host) of a GKE TPU slice, from its accelerator and topology labels."""
  if accelerator not in _TPU_2D + _TPU_3D:
    raise ValueError(f"unknown TPU accelerator {accelerator!r}; one of {_TPU_2D + _TPU_3D}")
  dims = 2 if accelerator in _TPU_2D else 3
  if not re.fullmatch(r"[1-9]\d*(x[1-9]\d*){%d}" % (dims - 1), topology):
    raise ValueError(f"--topology for {accelerator} is {dims} numbers joined by 'x' "
                     f"(e.g. {'4x4' if dims == 2 else '2x2x4'}), got {topology!r}")
  chips = math.prod(int(d) for d in topology.split("x"))
  if accelerator in _TPU_2D and chips <= _TPU_SINGLE_HOST_MAX:
    return 1, chips
  if chips % _TPU_CHIPS_PER_HOST:
    raise ValueError(f"topology {topology} has {chips} chips, not a multiple of "
                     f"{_TPU_CHIPS_PER_HOST} chips per host")
  return chips // _TPU_CHIPS_PER_HOST, _TPU_CHIPS_PER_HOST


def mounted_workdir(main_args: list[str]) -> tuple[str, list[str]]:
  """(the bucket of the last --workdir=gs://B/PATH, the args with it as /gcs/B/PATH)."""
  workdir = [a for a in main_args if a.startswith("--workdir=")][-1].split("=", 1)[1]
  bucket, _, path = workdir[len("gs://"):].partition("/")
  mounted = f"--workdir={GCS_MOUNT}/{bucket}" + (f"/{path}" if path else "")
  return bucket, [mounted if a.startswith("--workdir=") else a for a in main_args]


def manifest(args) -> dict:
  """The JobSet as a dict (what kubectl receives as YAML)."""
  bucket, main_args = mounted_workdir(args.main_args)
  env = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
  pod = {"restartPolicy": "Never", "terminationGracePeriodSeconds": args.grace_seconds}
  if args.gpu:
    hosts = args.num_nodes
    resources = {"nvidia.com/gpu": args.gpus_per_node}
    pod["nodeSelector"] = {"cloud.google.com/gke-accelerator": args.gpu}
    env += [
        {"name": "BIGPRETRAIN_COORDINATOR_ADDRESS",
         "value": f"{args.name}-{JOB}-0-0.{args.name}:{args.port}"},
        {"name": "BIGPRETRAIN_NUM_PROCESSES", "value": str(hosts)},
        {"name": "BIGPRETRAIN_PROCESS_ID", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
    ]
  else:
    hosts, chips = tpu_hosts(args.tpu, args.topology)
    resources = {"google.com/tpu": chips}
    pod["nodeSelector"] = {"cloud.google.com/gke-tpu-accelerator": args.tpu,
                           "cloud.google.com/gke-tpu-topology": args.topology}
    # The host's network for the slice's data-center traffic, as GKE's TPU examples do.
    pod["hostNetwork"] = True
    pod["dnsPolicy"] = "ClusterFirstWithHostNet"
    if args.num_slices > 1:
      env += [
          {"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": f"{args.name}-{JOB}-0-0.{args.name}"},
          {"name": "MEGASCALE_NUM_SLICES", "value": str(args.num_slices)},
          {"name": "MEGASCALE_SLICE_ID", "valueFrom": {"fieldRef": {
              "fieldPath": "metadata.labels['jobset.sigs.k8s.io/job-index']"}}},
      ]
  container = {
      "name": "train",
      "image": args.image,
      "command": ["python3", "-m", args.module, *main_args],
      "env": env,
      "resources": {"limits": resources},
      # grain's worker processes and NCCL share batches through /dev/shm (64 MB by default).
      "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                       {"name": "workdir", "mountPath": f"{GCS_MOUNT}/{bucket}"}],
  }
  if args.gpu:
    container["ports"] = [{"containerPort": args.port}]
  pod["containers"] = [container]
  pod["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}},
                    {"name": "workdir", "csi": {
                        "driver": "gcsfuse.csi.storage.gke.io",
                        "volumeAttributes": {"bucketName": bucket,
                                             "mountOptions": "implicit-dirs"}}}]
  metadata = {"name": args.name}
  if args.tpu:
    # All pods of the slice on one node pool (one slice), as JobSet's TPU guide requires.
    metadata["annotations"] = {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
  return {
      "apiVersion": "jobset.x-k8s.io/v1alpha2",
      "kind": "JobSet",
      "metadata": metadata,
      "spec": {
          "network": {"enableDNSHostnames": True, "subdomain": args.name},
          "failurePolicy": {"maxRestarts": args.max_restarts},
          "replicatedJobs": [{
              "name": JOB,
              "replicas": args.num_slices,
              "template": {"spec": {
                  "parallelism": hosts, "completions": hosts, "completionMode": "Indexed",
                  "backoffLimit": 0, "template": {
                      # The Cloud Storage FUSE sidecar that mounts the workdir's bucket.
                      "metadata": {"annotations": {"gke-gcsfuse/volumes": "true"}},
                      "spec": pod}}},
          }],
      },
  }


def parse(argv) -> argparse.Namespace:
  """Parses and checks the arguments; exits 2 with a message naming the problem."""
  p = argparse.ArgumentParser(
      prog="gke_jobset.py", description=__doc__.split("\n")[0],
      usage="%(prog)s --name=N --image=I (--gpu=G --num_nodes=K | --tpu=T --topology=AxB[xC]) "
            "[options] -- --config=... --workdir=gs://...")
  p.add_argument("--name", required=True, help="JobSet name (lowercase DNS label).")
  p.add_argument("--image", required=True, help="Container image with bigpretrain installed.")
  p.add_argument("--gpu", help="GKE accelerator label, e.g. nvidia-h100-80gb, "
                 "nvidia-h100-mega-80gb, nvidia-h200-141gb.")
  p.add_argument("--num_nodes", type=int, help="GPU nodes (one process each).")
  p.add_argument("--gpus_per_node", type=int, default=8)
  p.add_argument("--port", type=int, default=1234, help="jax.distributed coordinator port.")
  p.add_argument("--tpu", help=f"GKE TPU accelerator label, one of {_TPU_2D + _TPU_3D}.")
  p.add_argument("--topology", help="TPU slice topology, e.g. 4x4 (v5e, v6e) or 4x4x4 (v4, v5p).")
  p.add_argument("--num_slices", type=int, default=1,
                 help="TPU slices of --topology joined over the data-center network.")
  p.add_argument("--module", default="bigpretrain.main", help="python -m MODULE to run.")
  p.add_argument("--max_restarts", type=int, default=3)
  p.add_argument("--grace_seconds", type=int, default=300,
                 help="Time between SIGTERM and SIGKILL, for the final checkpoint.")
  p.add_argument("--dry_run", action="store_true", help="Print the manifest, apply nothing.")
  p.add_argument("main_args", nargs="*", help="Training flags, after --.")
  args = p.parse_args(argv)
  if not re.fullmatch(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", args.name):
    p.error(f"--name must be a lowercase DNS label of at most 40 characters (it prefixes every "
            f"pod's hostname), got {args.name!r}")
  if bool(args.gpu) == bool(args.tpu):
    p.error("pass exactly one of --gpu and --tpu")
  if args.gpu and (args.num_nodes is None or args.num_nodes < 1):
    p.error("--gpu needs --num_nodes >= 1")
  if args.tpu:
    if args.num_nodes is not None:
      p.error("--num_nodes is for GPUs; a TPU slice's host count follows from --topology")
    if not args.topology:
      p.error("--tpu needs --topology")
    try:
      hosts, _ = tpu_hosts(args.tpu, args.topology)
    except ValueError as e:
      p.error(str(e))
    if args.num_slices < 1 or (args.num_slices > 1 and hosts == 1):
      p.error(f"--num_slices={args.num_slices}: Multislice joins multi-host slices (>= 1; "
              f"{args.topology} is one host)")
  elif args.num_slices != 1:
    p.error("--num_slices is for TPU slices; GPU nodes are counted by --num_nodes")
  if not any(a.startswith("--config=") for a in args.main_args):
    p.error("the training flags after -- need --config=...")
  workdir = [a.split("=", 1)[1] for a in args.main_args if a.startswith("--workdir=")]
  if not workdir or not workdir[-1].startswith("gs://"):
    p.error("the training flags after -- need --workdir=gs://...: pods' disks vanish with them, "
            "and every host must read and write the same checkpoints")
  return args


def main(argv=None) -> int:
  args = parse(sys.argv[1:] if argv is None else argv)
  text = yaml.safe_dump(manifest(args), sort_keys=False)
  if args.dry_run:
    print(text, end="")
    return 0
  try:
    return subprocess.run(["kubectl", "apply", "-f", "-"], input=text, text=True,
                          check=False).returncode
  except FileNotFoundError:
    print("gke_jobset.py: kubectl not found; use --dry_run to print the manifest", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
