r"""Plan a config's train step ahead of time: memory, FLOPs and collectives per device.

  python -m bigpretrain.tools.plan --config=configs/semantic_softmax.py:model=vit_b16,dataset=imagenet21k_p \
      --topology=tpu:v5p:4x4x4 --mesh=data:1,fsdp:64,tensor:1 [--json]
  python -m bigpretrain.tools.plan --config=... --topology=gpu:h100:4x8   # 4 nodes of 8 GPUs.
  python -m bigpretrain.tools.plan --config=... --topology=tpu:v5e:16x16:4 \
      --mesh=data:4,fsdp:256,tensor:1   # 4 slices (Multislice): 'data' spans them.
  python -m bigpretrain.tools.plan --config=... --devices=64 --accelerator=h100  # XLA:CPU.
  python -m bigpretrain.tools.plan --config=... --topology=gpu:h100:1x1 --max_batch  # remat on, off
  python -m bigpretrain.tools.plan --config=configs/semantic_kd.py:model=tresnet_m,teacher=unused,dataset=imagenet21k_p \
      --teacher_model=tresnet_l --topology=gpu:h100:1x8      # distillation before the teacher exists
  python -m bigpretrain.tools.plan --config=configs/single_label.py:model=resnext101_32x48d,dataset=tfds:imagenet2012 \
      --step=infer --top_p=10 --topology=tpu:v5p:4x4x4       # a teacher ranking an unlabelled pool

--topology compiles with the accelerator's own compiler and no accelerator attached (libtpu,
pip install 'bigpretrain[tpu]'; the CUDA plugin, pip install 'bigpretrain[cuda]'); when it is
not installed the plan falls back to as many fake CPU devices, says so, and every figure names
its compiler. See bigpretrain.plan.aot_plan for what is measured and how the compilers differ.
"""
import json
import sys

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from bigpretrain.plan import accelerators
from bigpretrain.plan import aot_plan
from bigpretrain.tools import cli


def define_flags() -> None:
  """The command's flags, defined only when it runs (no clash with other commands' flags when
  modules are imported together, e.g. by the tests)."""
  config_flags.DEFINE_config_file("config", None, "Recipe config file (and :args).",
                                  lock_config=True)
  flags.DEFINE_integer("devices", None, "Fake CPU devices to plan for (XLA:CPU).")
  flags.DEFINE_string("topology", None, "tpu:CHIP:AxB[xC][:SLICES] (a TPU slice, or SLICES of "
                      "them: Multislice) or gpu:CHIP:NODESxGPUS (a GPU cluster): compile with "
                      "that accelerator's compiler, deviceless.")
  flags.DEFINE_string("mesh", "", "data:A,fsdp:B,tensor:C (wins over config.mesh).")
  flags.DEFINE_enum("accelerator", None, sorted(accelerators.ACCELERATORS),
                    "Accelerator whose memory the plan is checked against (default: the "
                    "topology's).")
  flags.DEFINE_integer("num_classes", None, "Classes of a dataset whose class list does not "
                       "ship with the package.")
  flags.DEFINE_string("teacher_model", None, "A distillation teacher's model name, planned in "
                      "place of the checkpoint objective.teacher_checkpoint names.")
  flags.DEFINE_enum("step", "train", aot_plan.STEPS, "The train step, or the inference "
                    "engine's pool step (eval-mode forward and top-P scores) at batch_size.")
  flags.DEFINE_integer("top_p", 10, "Classes kept per image by --step=infer.")
  flags.DEFINE_bool("json", False, "Print one JSON line instead of text.")
  flags.DEFINE_bool("flops_only", False, "Only the step's FLOPs per device (and with an "
                    "accelerator its roofline), traced, not compiled (one JSON line).")
  flags.DEFINE_bool("max_batch", False, "The largest per-device batch whose train step fits "
                    "the accelerator's HBM (or --memory_gib), for each of --remat: bisection "
                    "on the compiled memory, one compile per probe (one JSON line each).")
  flags.DEFINE_list("remat", ["none", "nothing_saveable"], "model.remat policies --max_batch "
                    "tries.")
  flags.DEFINE_float("memory_gib", None, "--max_batch's memory per device, GiB (default: the "
                     "accelerator's HBM).")
  flags.mark_flags_as_required(["config"])


def _devices(f):
  """The devices to plan for: the topology's (or, without its compiler, as many fake CPU
  devices, with a note on stderr) or --devices fake CPU devices. Before any jax backend starts."""
  if (f.devices is None) == (f.topology is None):
    cli.usage_error("Pass one of --topology=... and --devices=N.")
  topology = accelerators.parse_topology(f.topology) if f.topology else None
  if topology is not None:
    problem = accelerators.compiler_problem(topology.accelerator.platform)
    if problem is None:
      jax.config.update("jax_platforms", "cpu")  # The plugins' device checks are not needed.
      return accelerators.topology_devices(topology), topology.accelerator.name
    print(f"NOTE: planning {topology.spec} on {topology.num_devices} fake CPU devices "
          f"(XLA:CPU), not with its compiler: {problem}", file=sys.stderr, flush=True)
  count = topology.num_devices if topology else f.devices
  if count < 1:
    cli.usage_error(f"--devices={count} must be >= 1.")
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", count)
  if jax.device_count() != count:
    raise RuntimeError(f"jax started with {jax.device_count()} devices, not {count} "
                       "(XLA_FLAGS' xla_force_host_platform_device_count?).")
  return jax.devices(), topology.accelerator.name if topology else None


def _max_batch(f, config, devices, accelerator) -> None:
  if f.memory_gib is None and accelerator is None:
    raise ValueError("--max_batch needs --accelerator (its HBM) or --memory_gib.")
  if f.memory_gib is not None and not f.memory_gib > 0:
    raise ValueError(f"--memory_gib={f.memory_gib} must be > 0.")
  memory = (int(f.memory_gib * 2**30) if f.memory_gib is not None
            else accelerators.get(accelerator).hbm_bytes)
  for remat in f.remat:
    p = aot_plan.max_batch(config, memory, remat, f.num_classes, devices, f.teacher_model)
    print(json.dumps(p) if f.json else (
        f"remat {remat}: {p['max_batch_per_device']} images per device fit "
        f"{memory / 2**30:.2f} GiB (planned {(p['total_bytes'] or 0) / 2**30:.2f} GiB; "
        f"probes {p['probes']})"), flush=True)


def main(argv):
  cli.check_usage(argv)
  f = flags.FLAGS
  logging.set_verbosity(logging.WARNING)  # Not the per-parameter sharding lines.
  config = f.config
  with cli.user_errors(RuntimeError):
    devices, accelerator = _devices(f)
    if f.mesh:
      config = config.copy_and_resolve_references()
      with config.unlocked():
        config.mesh.update(aot_plan.parse_mesh(f.mesh))
    if f.max_batch:
      _max_batch(f, config, devices, f.accelerator or accelerator)
      return
    if f.flops_only:
      p = aot_plan.step_flops(config, f.num_classes, devices, teacher_model=f.teacher_model,
                              step=f.step, top_p=f.top_p,
                              accelerator=f.accelerator or accelerator)
      print(json.dumps(p), flush=True)
      return
    p = aot_plan.plan(config, f.num_classes, f.accelerator or accelerator, devices,
                      teacher_model=f.teacher_model, step=f.step, top_p=f.top_p)
  print(json.dumps(p) if f.json else aot_plan.describe(p), flush=True)


def parse_flags(argv: list[str]) -> list[str]:
  """cli.parse_flags, with --devices' fake CPU devices set first: a config that reads its
  checkpoint while it loads (transfer.py or swag_finetune.py with init=) starts JAX, and the
  CPU device count cannot change after that."""
  early = flags.FlagValues()
  flags.DEFINE_integer("devices", None, "", flag_values=early)
  flags.DEFINE_string("topology", None, "", flag_values=early)
  try:
    early(argv, known_only=True)
  except flags.Error:
    pass  # The full parse below names the bad value.
  if early.devices is not None and early.devices >= 1 and early.topology is None:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", early.devices)
  return cli.parse_flags(argv)


if __name__ == "__main__":
  define_flags()
  app.run(main, flags_parser=parse_flags)
