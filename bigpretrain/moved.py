"""Modules that moved to the package of their role keep their earlier import paths.

`import bigpretrain.zero_shot` (or `bigpretrain.hashtags.vocabulary`, `input_pipeline.demo`,
...) gives the module at its new place, the same module object, so code written against the
earlier layout keeps working and nothing is imported twice. New code uses the new paths.
Installed by `import bigpretrain` and `import input_pipeline`; pure Python.
"""
import importlib
import importlib.abc
import importlib.util
import sys

# Earlier dotted name (a module or a package prefix) -> where it lives now.
MOVED = {
    "bigpretrain.hashtags": "bigpretrain.swag",
    "bigpretrain.selection": "bigpretrain.semisup",
    "bigpretrain.evaluate": "bigpretrain.evaluators.evaluate",
    "bigpretrain.linear_probe": "bigpretrain.evaluators.linear_probe",
    "bigpretrain.convert": "bigpretrain.models.convert",
    "bigpretrain.accelerators": "bigpretrain.plan.accelerators",
    "bigpretrain.aot_plan": "bigpretrain.plan.aot_plan",
    "bigpretrain.flops": "bigpretrain.plan.flops",
    "bigpretrain.gpu_flags": "bigpretrain.plan.gpu_flags",
    "bigpretrain.hlo_collectives": "bigpretrain.plan.hlo_collectives",
    "bigpretrain.cache": "bigpretrain.runtime.cache",
    "bigpretrain.console": "bigpretrain.runtime.console",
    "bigpretrain.distributed": "bigpretrain.runtime.distributed",
    "bigpretrain.goodput": "bigpretrain.runtime.goodput",
    "bigpretrain.metric_writers": "bigpretrain.runtime.metric_writers",
    "bigpretrain.preemption": "bigpretrain.runtime.preemption",
    "bigpretrain.workdir_lock": "bigpretrain.runtime.workdir_lock",
    "bigpretrain.dedup": "bigpretrain.semisup.dedup",
    "bigpretrain.pool_predictions": "bigpretrain.semisup.pool_predictions",
    "bigpretrain.semi_supervised": "bigpretrain.semisup.semi_supervised",
    "bigpretrain.head_init": "bigpretrain.swag.head_init",
    "bigpretrain.zero_shot": "bigpretrain.swag.zero_shot",
    "input_pipeline.beam_images": "input_pipeline.jobs.beam_images",
    "input_pipeline.crawl_inputs": "input_pipeline.jobs.crawl_inputs",
    "input_pipeline.hashtag_job": "input_pipeline.jobs.hashtag_job",
    "input_pipeline.image_folder": "input_pipeline.jobs.image_folder",
    "input_pipeline.imagenet21k_p": "input_pipeline.jobs.imagenet21k_p",
    "input_pipeline.selection_job": "input_pipeline.jobs.selection_job",
    "input_pipeline.demo": "input_pipeline.sources.demo",
    "input_pipeline.demo_coarse": "input_pipeline.sources.demo_coarse",
    "input_pipeline.hashtag_demo": "input_pipeline.sources.hashtag_demo",
    "input_pipeline.hashtag_source": "input_pipeline.sources.hashtag_source",
    "input_pipeline.selection_source": "input_pipeline.sources.selection_source",
}


def new_name(name: str) -> str | None:
  """The current dotted name of a module imported under `name`, or None if it did not move."""
  for old, new in MOVED.items():
    if name == old or name.startswith(old + "."):
      return new + name[len(old):]
  return None


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Serves an earlier name with the module at its new place."""

  def find_spec(self, fullname, path, target=None):
    del path, target
    return importlib.util.spec_from_loader(fullname, self) if new_name(fullname) else None

  def create_module(self, spec):
    return importlib.import_module(new_name(spec.name))

  def exec_module(self, module):
    del module  # Already executed under its new name.


def install() -> None:
  if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.insert(0, _Alias())
