"""Small configs, subprocess runners and shared trained runs for the trainer tests."""
import fcntl
import hashlib
import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
JAX_CACHE = str(ROOT / ".cache" / "jax")


# The ImageNet-21K recipes' demo model (regnety_demo) compiles ~7x slower than vit_demo;
# trainer tests of those recipes run vit_demo.
VIT_DEMO_RECIPES = ("semantic_softmax", "single_label", "multi_label", "semantic_kd")


# Tests evaluate on the first 256 records of the eval split (the demo's validation split, 2,500
# shuffled records, took a third of a short test run).
EVAL_RECORDS = "[:256]"


def tiny_config(recipe: str = "semantic_softmax", **overrides):
  """The recipe's demo config, shortened for tests."""
  module = __import__(f"configs.{recipe}", fromlist=["get_config"])
  config = module.get_config()
  if recipe in VIT_DEMO_RECIPES:
    config.model = {"name": "vit_demo"}
  config.batch_size = 16
  config.total_steps = 6
  config.log_every_steps = 1
  config.eval_every_steps = 0
  config.ckpt_every_steps = 0
  config.compilation_cache_dir = JAX_CACHE
  config.data.eval_split = f"{config.data.eval_split}{EVAL_RECORDS}"
  if "fewshot" in config.evals:  # The recipe's probe reads ~7,500 records; tests of it set theirs.
    config.evals.fewshot.shots = ()
  return set_overrides(config, overrides)


def set_overrides(config, overrides: dict):
  """Sets dotted keys ('objective.label_smoothing') of `config`; returns it."""
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return config


def main_args(workdir, recipe="semantic_softmax", **overrides) -> list[str]:
  """Command-line args for `python -m bigpretrain.main` with test-sized overrides."""
  base = {"batch_size": 16, "total_steps": 6, "log_every_steps": 1, "eval_every_steps": 0,
          "ckpt_every_steps": 0, "compilation_cache_dir": JAX_CACHE,
          "data.eval_split": f"validation{EVAL_RECORDS}",
          "evals.fewshot.shots": "()"}  # The recipe's few-shot probe off (see tiny_config).
  if recipe in VIT_DEMO_RECIPES:
    base["model.name"] = "vit_demo"
  base.update(overrides)
  return [f"--config={ROOT / 'configs' / (recipe + '.py')}", f"--workdir={workdir}"] + [
      f"--config.{k}={v}" for k, v in base.items()]


# The suite's programs are tiny and run a few steps: compiling is most of their time. XLA:CPU
# with LLVM at -O0 compiles them about a third faster and runs them 2-3x slower, a net gain;
# without its MLIR fusion emitters (the classic elemental IR emitter instead) the demo models'
# train steps compile in about two thirds of that time again, and run no slower. Every
# process of the suite uses them (conftest.py, env(), the launches): the same code, so the
# same numbers wherever a test compares runs. jaxlib 0.11 no longer knows the classic
# emitter's flag (an unknown flag in XLA_FLAGS is fatal), so only older jaxlibs get it.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0" + (
    " --xla_cpu_use_fusion_emitters=false"
    if tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11)
    else "")


def env(num_devices: int = 1) -> dict:
  e = dict(os.environ)
  e["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={num_devices} {TEST_XLA_FLAGS}"
  e["JAX_PLATFORMS"] = "cpu"
  e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
  return e


def run_main(args, num_devices=1, timeout=600, **kw) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "bigpretrain.main"] + args, env=env(num_devices),
                        cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kw)


def popen_main(args, num_devices=1) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-m", "bigpretrain.main"] + args,
                          env=env(num_devices), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def random_checkpoint(folder, noise: float = 0.0, **overrides) -> str:
  """A single_label demo checkpoint (tiny_config + `overrides`) at step 1 with its initial
  weights, plus `noise` x N(0, 1) on every parameter (no zero head, no near-ties); no
  training. Returns `folder`."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from bigpretrain import checkpoint  # pylint: disable=import-outside-toplevel
  from bigpretrain import train  # pylint: disable=import-outside-toplevel
  config = tiny_config("single_label", **overrides)
  setup = train.build_model(config)
  params, extra = setup.model_def.create(jax.random.key(0))
  if noise:
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    params = jax.tree.unflatten(treedef, [p + noise * jax.random.normal(k, p.shape, p.dtype)
                                          for p, k in zip(leaves, keys)])
  info = setup.dataset.info
  meta = checkpoint.run_meta(config, setup.model_def.config(), info.class_names,
                             info.num_classes)
  ckpt = checkpoint.Checkpointer(str(pathlib.Path(folder) / "checkpoints"), async_save=False,
                                 meta=meta)
  zero = jnp.zeros((), jnp.int32)
  ckpt.save(1, {"params": params, "extra": extra, "step": zero, "opt_state": zero,
                "skipped_records": zero})
  ckpt.close()
  return str(folder)


def _code_digest() -> str:
  """A digest of the code a trained run depends on: a change to it rebuilds shared runs."""
  h = hashlib.sha256()
  for folder in ("bigpretrain", "input_pipeline", "configs"):
    for path in sorted((ROOT / folder).rglob("*.py")):
      h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
  h.update(pathlib.Path(__file__).read_bytes())
  return h.hexdigest()[:16]


def shared_run(name: str, build) -> str:
  """A run folder that `build(folder)` fills once for every test of every pytest worker, and
  again only when the code changes (kept under .cache/test_runs, keyed by the code's digest).
  Tests only read it. Returns the folder."""
  root = ROOT / ".cache" / "test_runs"
  root.mkdir(parents=True, exist_ok=True)
  folder = root / f"{name}-{_code_digest()}"
  with open(root / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # One builder; the other workers wait for its result.
    if not (folder / "DONE").exists():
      shutil.rmtree(folder, ignore_errors=True)
      build(str(folder))
      (folder / "DONE").touch()
  return str(folder)
