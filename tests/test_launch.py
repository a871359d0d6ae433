"""Launchers: the commands and manifests they print with --dry_run, their argument errors, and
(with stand-ins for gcloud, srun, scontrol and kubectl on PATH) what they actually run."""
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import time

import pytest
import yaml

from bigpretrain.runtime import distributed
from tests import helpers

LAUNCH = helpers.ROOT / "launch"
MAIN = ["--config=configs/semantic_softmax.py:dataset=imagenet21k_p,data_dir=gs://b/data",
        "--workdir=gs://b/runs/ss", "--config.note=two words"]


def run(cmd, env=None, **kw):
  return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=60,
                        env={**os.environ, **(env or {})}, **kw)


def lines(stdout: str) -> list[list[str]]:
  """Each printed line as the argv a shell would run ('a || b' split into two)."""
  out = []
  for line in stdout.strip().splitlines():
    words = shlex.split(line)
    while "||" in words:
      i = words.index("||")
      out.append(words[:i])
      words = words[i + 1:]
    out.append(words)
  return out


def fake_tool(bin_dir: pathlib.Path, name: str, body: str) -> None:
  """An executable `name` on a test PATH, logging its argv (one line) to $FAKE_LOG."""
  path = bin_dir / name
  path.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "' + name + ' $*" >> "$FAKE_LOG"\n' + body)
  path.chmod(0o755)


# ---------------------------------------------------------------------------------- TPU pod

TPU = ["gcloud", "compute", "tpus", "tpu-vm"]


def test_tpu_pod_dry_run_prints_each_step():
  r = run([LAUNCH / "tpu_pod.sh", "--dry_run", "--name=pod1", "--zone=us-east5-a",
           "--accelerator_type=v5p-64", "--project=proj", "--spot", "--", *MAIN])
  assert r.returncode == 0, r.stderr
  where = ["--zone=us-east5-a", "--project=proj"]
  archive = f"{os.environ.get('TMPDIR', '/tmp')}/bigpretrain_pod1.tar.gz"
  install = "python3 -m pip install -q -e $HOME/bigpretrain 'jax[tpu]'"
  # The gs:// workdir: its bucket mounted with gcsfuse at /gcs/b on every worker.
  main = " ".join(shlex.quote(a.replace("--workdir=gs://", "--workdir=/gcs/")) for a in MAIN)
  mount = ("(command -v gcsfuse > /dev/null || (echo \"deb https://packages.cloud.google.com/apt "
           "gcsfuse-$(lsb_release -c -s) main\" | sudo tee /etc/apt/sources.list.d/gcsfuse.list"
           " && curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo tee "
           "/etc/apt/trusted.gpg.d/gcsfuse.asc > /dev/null && sudo apt-get update -q && sudo "
           "apt-get install -y -q gcsfuse)) && sudo mkdir -p /gcs/b && sudo chown "
           "$(id -u):$(id -g) /gcs/b && (mountpoint -q /gcs/b || gcsfuse --implicit-dirs b "
           "/gcs/b) && ")
  rc = "$HOME/bigpretrain_run.rc"
  assert lines(r.stdout) == [
      TPU + ["describe", "pod1", *where, "--format=value(state)"],
      TPU + ["create", "pod1", *where, "--accelerator-type=v5p-64", "--version=v2-alpha-tpuv5",
             "--spot"],
      ["git", "-C", str(helpers.ROOT), "archive", "--format=tar.gz", f"--output={archive}",
       "HEAD"],
      TPU + ["scp", archive, "pod1:bigpretrain.tar.gz", *where, "--worker=all"],
      TPU + ["ssh", "pod1", *where, "--worker=all",
             "--command=rm -rf $HOME/bigpretrain && mkdir -p $HOME/bigpretrain && tar -xzf "
             f"$HOME/bigpretrain.tar.gz -C $HOME/bigpretrain && {install}"],
      TPU + ["ssh", "pod1", *where, "--worker=all",
             f"--command={mount}cd $HOME/bigpretrain && rm -f {rc} && nohup sh -c "
             f"'\"$@\"; echo $? > {rc}' sh python3 -m bigpretrain.main {main} > "
             "$HOME/bigpretrain_run.log 2>&1 < /dev/null & echo $! > $HOME/bigpretrain_run.pid"],
      TPU + ["ssh", "pod1", *where, "--worker=0", "--command=tail -n +1 -F "
             "--pid=$(cat $HOME/bigpretrain_run.pid) $HOME/bigpretrain_run.log; "
             f"exit $(cat {rc} 2>/dev/null || echo 1)"],
  ]


def test_tpu_pod_dry_run_clone_and_default_versions():
  base = ["--dry_run", "--name=p", "--zone=z"]
  r = run([LAUNCH / "tpu_pod.sh", *base, "--accelerator_type=v6e-16", "--repo=https://h/r.git",
           "--branch=dev", "--remote_dir=code", "--module=bigpretrain.tools.infer", "--", *MAIN])
  assert r.returncode == 0, r.stderr
  steps = lines(r.stdout)
  assert steps[1][-1] == "--version=v2-alpha-tpuv6e"
  assert len(steps) == 5  # describe, create, fetch+install, run, stream: nothing copied
  assert steps[2][-1] == ("--command=rm -rf $HOME/code && git clone --depth=1 --branch=dev "
                          "https://h/r.git $HOME/code && python3 -m pip install -q -e "
                          "$HOME/code 'jax[tpu]'")
  assert "python3 -m bigpretrain.tools.infer --config=" in steps[3][-1]
  for accelerator, version in [("v4-32", "tpu-ubuntu2204-base"),
                               ("v5litepod-64", "v2-alpha-tpuv5-lite")]:
    r = run([LAUNCH / "tpu_pod.sh", *base, f"--accelerator_type={accelerator}", "--", *MAIN])
    assert lines(r.stdout)[1][-1] == f"--version={version}"


def test_tpu_pod_multislice_is_one_queued_resource_whose_nodes_all_run(tmp_path):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  # describe: absent at first; once created, waiting for capacity twice, then active.
  fake_tool(bin_dir, "gcloud", '[[ $4 == describe ]] || exit 0\n'
            'n=$(cat "$FAKE_LOG.n" 2>/dev/null || echo 0); echo $((n + 1)) > "$FAKE_LOG.n"\n'
            '((n == 0)) && exit 1\n((n < 3)) && echo WAITING_FOR_RESOURCES || echo ACTIVE\n')
  env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(tmp_path / "log"),
         "TMPDIR": str(tmp_path), "BIGPRETRAIN_POLL_SECONDS": "0"}
  args = ["--name=p", "--zone=z", "--accelerator_type=v5p-16", "--num_slices=2", "--spot", "--",
          *MAIN]
  printed = lines(run([LAUNCH / "tpu_pod.sh", "--dry_run", *args], env).stdout)
  queued = ["gcloud", "compute", "tpus", "queued-resources"]
  assert printed[0] == [*queued, "describe", "p", "--zone=z", "--format=value(state.state)"]
  assert printed[1] == [*queued, "create", "p", "--zone=z", "--accelerator-type=v5p-16",
                        "--runtime-version=v2-alpha-tpuv5", "--node-count=2", "--node-prefix=p",
                        "--spot"]
  # Each slice's node gets the code and starts the run; the log streams from slice 0.
  assert [(c[4], c[5]) for c in printed[3:]] == [
      ("scp", printed[3][5]), ("ssh", "p-0"), ("scp", printed[5][5]), ("ssh", "p-1"),
      ("ssh", "p-0"), ("ssh", "p-1"), ("ssh", "p-0")]
  assert printed[3][6:] == ["p-0:bigpretrain.tar.gz", "--zone=z", "--worker=all"]
  assert printed[5][6] == "p-1:bigpretrain.tar.gz"
  assert printed[-1][-2] == "--worker=0" and "tail -n +1 -F" in printed[-1][-1]
  r = run([LAUNCH / "tpu_pod.sh", *args], env)
  assert r.returncode == 0, r.stderr
  assert r.stderr.count("waiting for queued resource p (WAITING_FOR_RESOURCES)") == 2
  calls = (tmp_path / "log").read_text().splitlines()
  describe = " ".join(printed[0])
  assert calls == [describe, " ".join(printed[1]), describe, describe, describe] + [
      " ".join(argv) for argv in printed[3:]]


@pytest.mark.parametrize("args, message", [
    (["--zone=z", "--accelerator_type=v5p-8"], "--name is required"),
    (["--name=p", "--zone=z", "--accelerator_type=v5p-8", "--num_slices=0"],
     "--num_slices must be an integer >= 1"),
    (["--name=p", "--accelerator_type=v5p-8"], "--zone is required"),
    (["--name=p", "--zone=z"], "--accelerator_type is required"),
    (["--name=p", "--zone=z", "--accelerator_type=v9x-8"], "pass --version"),
    (["--name=p", "--zone=z", "--accelerator_type=v5p-8", "--branch=b"], "--branch needs --repo"),
    (["--name=p", "--zone=z", "--accelerator_type=v5p-8", "--workers=2"], "unknown option"),
])
def test_tpu_pod_argument_errors(args, message):
  r = run([LAUNCH / "tpu_pod.sh", "--dry_run", *args, "--", *MAIN])
  assert r.returncode == 2 and message in r.stderr and not r.stdout


def test_tpu_pod_needs_config_and_workdir():
  base = [LAUNCH / "tpu_pod.sh", "--dry_run", "--name=p", "--zone=z", "--accelerator_type=v5p-8"]
  r = run([*base, "--", "--workdir=gs://w"])
  assert r.returncode == 2 and "need --config" in r.stderr
  r = run([*base, "--", "--config=c.py"])
  assert r.returncode == 2 and "need --workdir" in r.stderr


@pytest.mark.parametrize("state", ["", "READY", "PREEMPTED"])
def test_tpu_pod_creates_only_a_missing_slice_and_runs_the_printed_steps(tmp_path, state):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  # describe succeeds only when the slice exists, printing its state; a preempted Spot
  # slice cannot be restarted: it is deleted and created again.
  exists = state == "READY"
  describe = f"echo {state}; exit 0" if state else "exit 1"
  fake_tool(bin_dir, "gcloud", f'[[ $4 == describe ]] && {{ {describe}; }}\nexit 0\n')
  env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(tmp_path / "log"),
         "TMPDIR": str(tmp_path)}
  args = ["--name=p", "--zone=z", "--accelerator_type=v5p-8", "--", *MAIN]
  printed = lines(run([LAUNCH / "tpu_pod.sh", "--dry_run", *args], env).stdout)
  r = run([LAUNCH / "tpu_pod.sh", *args], env)
  assert r.returncode == 0, r.stderr
  calls = (tmp_path / "log").read_text().splitlines()
  # printed[2] is the local `git archive`, real here; the rest went to the stand-in gcloud.
  delete = [TPU + ["delete", "p", "--zone=z", "--quiet"]] if state == "PREEMPTED" else []
  expected = [printed[0]] + delete + ([] if exists else [printed[1]]) + printed[3:]
  assert calls == [" ".join(argv) for argv in expected]
  # The copy step really archived this checkout's HEAD.
  assert (tmp_path / "bigpretrain_p.tar.gz").stat().st_size > 0


# ---------------------------------------------------------------------------------- SLURM

def test_slurm_header_one_task_per_gpu_and_term_before_the_limit():
  header = [l for l in (LAUNCH / "slurm.sbatch").read_text().splitlines()
            if l.startswith("#SBATCH")]
  assert "#SBATCH --ntasks-per-node=8" in header and "#SBATCH --gpus-per-node=8" in header
  # Per-task GPU binding would hide the GPU JAX's SLURM detection picks (SLURM_LOCALID).
  assert not any("--gpus-per-task" in l for l in header)
  # B: = the batch shell gets the signal and forwards it; the lead time leaves room to save.
  signal_lines = [l for l in header if l.startswith("#SBATCH --signal=")]
  assert len(signal_lines) == 1 and signal_lines[0].startswith("#SBATCH --signal=B:TERM@")
  assert int(signal_lines[0].rsplit("@", 1)[1]) >= 120


def test_a_slurm_batch_script_without_srun_is_told(monkeypatch):
  monkeypatch.setenv("SLURM_JOB_ID", "123")
  monkeypatch.setenv("SLURM_NTASKS", "4")
  monkeypatch.delenv("SLURM_STEP_NODELIST", raising=False)
  with pytest.raises(ValueError, match="SLURM_NTASKS=4 .* Start the tasks with srun"):
    distributed.detect()
  monkeypatch.setenv("SLURM_STEP_NODELIST", "node[001-004]")  # A task srun started.
  assert distributed.detect() == ("slurm", {})
  # The launchers' own variables: a bad number is named.
  monkeypatch.setenv("BIGPRETRAIN_COORDINATOR_ADDRESS", "host:1234")
  monkeypatch.setenv("BIGPRETRAIN_NUM_PROCESSES", "two")
  monkeypatch.setenv("BIGPRETRAIN_PROCESS_ID", "0")
  with pytest.raises(ValueError, match="BIGPRETRAIN_NUM_PROCESSES='two' must be an integer"):
    distributed.detect()


def test_slurm_dry_run_prints_srun():
  r = run(["bash", LAUNCH / "slurm.sbatch", "--dry_run", "--module=bigpretrain.tools.infer", "--",
           *MAIN], {"PYTHON": "/opt/venv/bin/python"})
  assert r.returncode == 0, r.stderr
  assert lines(r.stdout) == [["srun", "--kill-on-bad-exit=1", "/opt/venv/bin/python", "-m",
                              "bigpretrain.tools.infer", *MAIN]]


@pytest.mark.parametrize("args, message", [
    (["--", "--workdir=/w"], "need --config"),
    (["--", "--config=c.py"], "need --workdir"),
    (["--nodes=2", "--", *MAIN], "unknown option --nodes=2"),
])
def test_slurm_argument_errors(args, message):
  r = run(["bash", LAUNCH / "slurm.sbatch", "--dry_run", *args])
  assert r.returncode == 2 and message in r.stderr and not r.stdout


@pytest.mark.parametrize("requeue", [False, True])
def test_slurm_forwards_sigterm_to_the_tasks_and_requeues(tmp_path, requeue):
  """SLURM's B:TERM reaches the batch shell; the task (here a stand-in trainer behind a
  stand-in srun) must get SIGTERM, exit 0, and with --requeue the job is requeued."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  fake_tool(bin_dir, "srun", 'while [[ $1 == --* ]]; do shift; done\nexec "$@"\n')
  fake_tool(bin_dir, "scontrol", "exit 0\n")
  trainer = tmp_path / "trainer"  # saves and exits 0 on SIGTERM, like bigpretrain.train
  trainer.write_text("#!/usr/bin/env bash\ntrap 'echo saved > \"$SAVED\"; kill $!; exit 0' TERM\n"
                     "touch \"$STARTED\"\nsleep 60 & wait\n")
  trainer.chmod(0o755)
  env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(trainer),
         "FAKE_LOG": str(tmp_path / "log"), "STARTED": str(tmp_path / "started"),
         "SAVED": str(tmp_path / "saved"), "SLURM_JOB_ID": "4242"}
  cmd = ["bash", str(LAUNCH / "slurm.sbatch"), *(["--requeue"] if requeue else []), "--", *MAIN]
  proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 30
  while not (tmp_path / "started").exists():
    assert time.time() < deadline and proc.poll() is None, proc.communicate()
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  _, stderr = proc.communicate(timeout=30)
  assert proc.returncode == 0, stderr
  assert (tmp_path / "saved").read_text() == "saved\n"
  calls = (tmp_path / "log").read_text().splitlines()
  assert calls[0] == f"srun --kill-on-bad-exit=1 {trainer} -m bigpretrain.main {' '.join(MAIN)}"
  assert calls[1:] == (["scontrol requeue 4242"] if requeue else [])


# ---------------------------------------------------------------------------------- GKE

def jobset(*args, env=None):
  r = run([sys.executable, LAUNCH / "gke_jobset.py", "--dry_run", "--name=ss", "--image=img:1",
           *args, "--", *MAIN], env)
  assert r.returncode == 0, r.stderr
  return yaml.safe_load(r.stdout)


def pod_of(m):
  (job,) = m["spec"]["replicatedJobs"]
  return job["template"]["spec"], job["template"]["spec"]["template"]["spec"]


def test_gke_gpu_jobset():
  m = jobset("--gpu=nvidia-h100-mega-80gb", "--num_nodes=4")
  assert m["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and m["kind"] == "JobSet"
  assert m["metadata"] == {"name": "ss"}
  assert m["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": "ss"}
  job, pod = pod_of(m)
  assert (job["parallelism"], job["completions"], job["completionMode"], job["backoffLimit"]) == (
      4, 4, "Indexed", 0)
  assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-mega-80gb"}
  assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] == 300
  (c,) = pod["containers"]
  assert c["image"] == "img:1"
  # The gs:// workdir is its bucket, mounted by GKE's Cloud Storage FUSE driver.
  mounted = [a.replace("--workdir=gs://b/", "--workdir=/gcs/b/") for a in MAIN]
  assert c["command"] == ["python3", "-m", "bigpretrain.main", *mounted]
  assert {"name": "workdir", "mountPath": "/gcs/b"} in c["volumeMounts"]
  assert {"name": "workdir", "csi": {"driver": "gcsfuse.csi.storage.gke.io", "volumeAttributes": {
      "bucketName": "b", "mountOptions": "implicit-dirs"}}} in pod["volumes"]
  assert m["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"] == {
      "annotations": {"gke-gcsfuse/volumes": "true"}}
  assert c["resources"] == {"limits": {"nvidia.com/gpu": 8}}
  env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
  # Pod 0 of replicated job 'workers' in JobSet 'ss' is ss-workers-0-0 under subdomain ss.
  assert env["BIGPRETRAIN_COORDINATOR_ADDRESS"] == "ss-workers-0-0.ss:1234"
  assert env["BIGPRETRAIN_NUM_PROCESSES"] == "4"
  assert env["BIGPRETRAIN_PROCESS_ID"] == {"fieldRef": {
      "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
  assert c["ports"] == [{"containerPort": 1234}]
  assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
  assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]


@pytest.mark.parametrize("accelerator, topology, hosts, chips", [
    ("tpu-v5p-slice", "4x4x4", 16, 4),  # 64 chips, 4 per VM
    ("tpu-v4-podslice", "2x2x1", 1, 4),
    ("tpu-v6e-slice", "4x4", 4, 4),  # 16 chips: multi-host, 4 per VM
    ("tpu-v6e-slice", "2x4", 1, 8),  # 8 chips: one VM
    ("tpu-v5-lite-podslice", "16x16", 64, 4),
])
def test_gke_tpu_jobset(accelerator, topology, hosts, chips):
  m = jobset(f"--tpu={accelerator}", f"--topology={topology}")
  assert m["metadata"]["annotations"] == {
      "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
  job, pod = pod_of(m)
  assert (job["parallelism"], job["completions"]) == (hosts, hosts)
  assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": accelerator,
                                 "cloud.google.com/gke-tpu-topology": topology}
  (c,) = pod["containers"]
  assert c["resources"] == {"limits": {"google.com/tpu": chips}}
  # JAX finds the slice from GKE's TPU_WORKER_* variables: no coordinator of ours.
  assert not any(e["name"].startswith("BIGPRETRAIN_") for e in c["env"])
  assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"


def test_gke_tpu_multislice_jobset():
  m = jobset("--tpu=tpu-v5p-slice", "--topology=2x2x4", "--num_slices=3")
  (replicated,) = m["spec"]["replicatedJobs"]
  job, pod = pod_of(m)
  assert replicated["replicas"] == 3 and (job["parallelism"], job["completions"]) == (4, 4)
  env = {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["containers"][0]["env"]}
  # Slice 0's first pod is ss-workers-0-0; each Job of the JobSet is one slice.
  assert env["MEGASCALE_COORDINATOR_ADDRESS"] == "ss-workers-0-0.ss"
  assert env["MEGASCALE_NUM_SLICES"] == "3"
  assert env["MEGASCALE_SLICE_ID"] == {"fieldRef": {
      "fieldPath": "metadata.labels['jobset.sigs.k8s.io/job-index']"}}
  # One slice per node pool.
  assert m["metadata"]["annotations"] == {
      "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
  single = jobset("--tpu=tpu-v5p-slice", "--topology=2x2x4")
  assert single["spec"]["replicatedJobs"][0]["replicas"] == 1
  assert not any(e["name"].startswith("MEGASCALE_")
                 for e in pod_of(single)[1]["containers"][0]["env"])


@pytest.mark.parametrize("args, message", [
    (["--name=ss", "--gpu=nvidia-h100-80gb", "--num_nodes=2"], "required: --image"),
    (["--name=ss", "--image=i", "--tpu=tpu-v6e-slice", "--topology=2x4", "--num_slices=2"],
     "2x4 is one host"),
    (["--name=ss", "--image=i", "--gpu=g", "--num_nodes=2", "--num_slices=2"],
     "--num_slices is for TPU slices"),
    (["--name=ss", "--image=i"], "exactly one of --gpu and --tpu"),
    (["--name=ss", "--image=i", "--gpu=g", "--tpu=tpu-v5p-slice", "--topology=2x2x1"],
     "exactly one of --gpu and --tpu"),
    (["--name=ss", "--image=i", "--gpu=nvidia-h100-80gb"], "--gpu needs --num_nodes"),
    (["--name=ss", "--image=i", "--tpu=tpu-v5p-slice"], "--tpu needs --topology"),
    (["--name=ss", "--image=i", "--tpu=tpu-v6e-slice", "--topology=4x4x4"], "2 numbers"),
    (["--name=ss", "--image=i", "--tpu=tpu-v9-slice", "--topology=4x4"], "unknown TPU"),
    (["--name=ss", "--image=i", "--tpu=tpu-v5p-slice", "--topology=2x2x4", "--num_nodes=4"],
     "follows from --topology"),
    (["--name=SS_1", "--image=i", "--gpu=g", "--num_nodes=1"], "lowercase DNS label"),
])
def test_gke_argument_errors(args, message):
  r = run([sys.executable, LAUNCH / "gke_jobset.py", "--dry_run", *args, "--", *MAIN])
  assert r.returncode == 2 and message in r.stderr and not r.stdout


def test_gke_needs_config_and_a_shared_workdir():
  base = [sys.executable, LAUNCH / "gke_jobset.py", "--dry_run", "--name=ss", "--image=i",
          "--gpu=g", "--num_nodes=1", "--"]
  r = run([*base, "--workdir=gs://w"])
  assert r.returncode == 2 and "need --config" in r.stderr
  r = run([*base, "--config=c.py", "--workdir=/tmp/run"])
  assert r.returncode == 2 and "--workdir=gs://" in r.stderr


def test_gke_applies_the_printed_manifest(tmp_path):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  fake_tool(bin_dir, "kubectl", 'cat > "$FAKE_LOG.stdin"\n')
  env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(tmp_path / "log")}
  args = ["--name=ss", "--image=i", "--gpu=nvidia-h100-80gb", "--num_nodes=2", "--", *MAIN]
  printed = run([sys.executable, LAUNCH / "gke_jobset.py", "--dry_run", *args], env).stdout
  r = run([sys.executable, LAUNCH / "gke_jobset.py", *args], env)
  assert r.returncode == 0, r.stderr
  assert (tmp_path / "log").read_text() == "kubectl apply -f -\n"
  assert (tmp_path / "log.stdin").read_text() == printed


# ---------------------------------------------------------------------------------- local

@pytest.mark.multiprocess
def test_local_dry_run_prints_the_processes_it_starts(tmp_path):
  fake_python = tmp_path / "python"
  fake_python.write_text('#!/usr/bin/env bash\necho "$XLA_FLAGS|$JAX_PLATFORMS|$*" >> "$LOG"\n')
  fake_python.chmod(0o755)
  env = {"PYTHON": str(fake_python), "LOG": str(tmp_path / "log"), "BIGPRETRAIN_PORT": "23456",
         "XLA_FLAGS": ""}
  cmd = [LAUNCH / "local.sh", "2", "--devices_per_process=4"]
  r = run([*cmd, "--dry_run", "--", *MAIN], env)
  assert r.returncode == 0, r.stderr
  printed = lines(r.stdout)
  flags = "--xla_force_host_platform_device_count=4"
  assert printed == [["env", f"XLA_FLAGS={flags}", "JAX_PLATFORMS=cpu", str(fake_python), "-m",
                      "bigpretrain.main", *MAIN, "--coordinator_address=127.0.0.1:23456",
                      "--num_processes=2", f"--process_id={i}"] for i in range(2)]
  assert not (tmp_path / "log").exists()
  r = run([*cmd, "--", *MAIN], env)
  assert r.returncode == 0, r.stderr
  started = sorted((tmp_path / "log").read_text().splitlines())
  assert started == [f"{p[1][len('XLA_FLAGS='):]}|cpu|{' '.join(p[4:])}" for p in printed]


def test_local_waits_for_the_saves_on_sigterm_and_stops_all_when_one_fails(tmp_path):
  trainer = tmp_path / "python"  # A stand-in: saves for 1 s on SIGTERM; FAIL=i exits 3
  # (once process 0 has started and can take the SIGTERM).
  trainer.write_text(
      '#!/usr/bin/env bash\nfor a in "$@"; do [[ $a == --process_id=* ]] && id=${a#*=}; done\n'
      '[[ $id == "$FAIL" ]] && { until [[ -e "$STARTED.0" ]]; do sleep 0.05; done; exit 3; }\n'
      "trap 'sleep 1; echo $id >> \"$SAVED\"; kill $! 2>/dev/null; exit 0' TERM\n"
      'touch "$STARTED.$id"\nsleep 60 & wait\n')
  trainer.chmod(0o755)
  env = {**os.environ, "PYTHON": str(trainer), "SAVED": str(tmp_path / "saved"),
         "STARTED": str(tmp_path / "started"), "FAIL": ""}
  cmd = [str(LAUNCH / "local.sh"), "2", "--", *MAIN]
  proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 30
  while not all((tmp_path / f"started.{i}").exists() for i in range(2)):
    assert time.time() < deadline and proc.poll() is None, proc.communicate()
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  _, stderr = proc.communicate(timeout=30)
  assert proc.returncode == 0, stderr  # Only once both processes had saved.
  assert sorted((tmp_path / "saved").read_text().split()) == ["0", "1"]
  failed = {**env, "FAIL": "1", "SAVED": str(tmp_path / "saved_after_failure"),
            "STARTED": str(tmp_path / "started_again")}  # Process 1 fails once 0 has started.
  r = subprocess.run(cmd, env=failed, capture_output=True, text=True, timeout=60)
  assert r.returncode == 3, r.stderr
  assert "exited with status 3; stopping the others" in r.stderr
  # Process 0 was stopped (its SIGTERM handler ran), not waited for through its 60 s.
  assert (tmp_path / "saved_after_failure").read_text().split() == ["0"]
  r = subprocess.run([str(LAUNCH / "local.sh"), "two", "--", *MAIN], capture_output=True,
                     text=True, timeout=30)
  assert r.returncode == 2 and "N=two must be a positive integer" in r.stderr
  r = subprocess.run([str(LAUNCH / "local.sh"), "2", "--devices_per_process=abc", "--", *MAIN],
                     capture_output=True, text=True, timeout=30)
  assert r.returncode == 2 and r.stderr.startswith(
      "--devices_per_process=abc must be a positive integer; usage:"), r.stderr


@pytest.mark.parametrize("address, n, i, message", [
    ("nohost", 2, 0, "must be host:port"),
    ("host:port", 2, 0, "must be host:port"),
    ("host:70000", 2, 0, "must be host:port"),
    ("host:1234", 2, 2, r"process_id=2 must be in \[0, num_processes=2\)"),
    ("host:1234", 0, 0, r"process_id=0 must be in \[0, num_processes=0\)"),
])
def test_a_bad_explicit_coordinator_is_refused_before_joining(monkeypatch, address, n, i,
                                                               message):
  monkeypatch.setattr(distributed.jax.distributed, "initialize",
                      lambda **kw: pytest.fail(f"initialize called with {kw}"))
  with pytest.raises(ValueError, match=message):
    distributed.maybe_initialize(address, n, i)


def test_joining_says_what_it_waits_for_before_it_blocks(monkeypatch, capsys):
  """jax.distributed.initialize waits for every process, silently, then ends the process
  when one never came: the wait is said first."""
  joined = []

  def initialize(**kwargs):
    joined.append((kwargs, capsys.readouterr().out))

  monkeypatch.setattr(distributed.jax.distributed, "initialize", initialize)
  monkeypatch.setattr(distributed, "select_platforms", lambda: "cpu")
  monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)
  distributed.maybe_initialize("10.0.0.1:1234", 2, 1)
  (kwargs, said), = joined
  assert kwargs == {"coordinator_address": "10.0.0.1:1234", "num_processes": 2,
                    "process_id": 1, "initialization_timeout": distributed.INIT_TIMEOUT_S}
  assert said.strip() == ("Joining the run's processes (explicit: process 1 of 2, coordinator "
                          "10.0.0.1:1234); waiting up to 300 s for all of them to start.")



def test_processes_on_this_host_counts_the_processes_with_its_host_name(monkeypatch):
  """One process per GPU (launch/slurm.sbatch): the 8 processes of a host share its /dev/shm,
  which the data workers' shared-memory check counts, and the first of them warns of it."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  assert distributed.processes_on_this_host() == (1, True)  # One process: no collective.
  monkeypatch.setattr(distributed.jax, "process_count", lambda: 16)
  sent = {}

  def sends(name):  # What a process on host `name` contributes to the all-gather.
    monkeypatch.setattr(distributed.socket, "gethostname", lambda: name)
    monkeypatch.setattr(multihost_utils, "process_allgather",
                        lambda x: sent.setdefault(name, np.array(x))[None])
    distributed.processes_on_this_host()
    return sent[name]

  hosts = ["node-a"] * 8 + ["node-b"] * 5 + ["node-c"] * 3
  gathered = np.stack([sends(name) for name in hosts])
  assert len({v.tobytes() for v in sent.values()}) == 3  # One value per host name.
  # int32: a device gather without jax_enable_x64 turns int64 into int32 (no match left).
  assert {v.dtype for v in sent.values()} == {np.dtype(np.int32)}
  monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: gathered)
  for process, name in enumerate(hosts):  # The first process of each host says its lines.
    monkeypatch.setattr(distributed.jax, "process_index", lambda process=process: process)
    monkeypatch.setattr(distributed.socket, "gethostname", lambda name=name: name)
    assert distributed.processes_on_this_host() == (hosts.count(name), process in (0, 8, 13))
