"""Test setup: 8 fake CPU devices, caches inside the workspace, absl flags parsed."""
import collections
import os
import pathlib

_ROOT = pathlib.Path(__file__).resolve().parent.parent
os.environ.setdefault("BIGPRETRAIN_CACHE", str(_ROOT / ".cache" / "bigpretrain"))

from tests import helpers  # pylint: disable=g-import-not-at-top,wrong-import-position
from tests import scheduling  # pylint: disable=g-import-not-at-top,wrong-import-position

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {helpers.TEST_XLA_FLAGS}".strip()

import jax  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top

# CPU whatever accelerator plugins are installed (libtpu, the CUDA plugin: their compile-only
# devices come from bigpretrain.plan.accelerators, not from the default backend).
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir", str(_ROOT / ".cache" / "jax"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
flags.FLAGS.mark_as_parsed()  # grain worker processes read absl flags.

from bigpretrain import train  # pylint: disable=g-import-not-at-top,wrong-import-position



# The file of the suite's longest test (the accelerator suite's dry run, a subprocess).
_FIRST = "test_accelerator_suite.py"


def pytest_collection_modifyitems(items):
  """_FIRST's file first, so that its long test does not run alone at the end; then the
  files with the most tests first, xdist's own order (pytest.ini keeps this one)."""
  count = collections.Counter(item.path for item in items)
  items.sort(key=lambda item: (item.path.name != _FIRST, -count[item.path]))  # Stable.


def pytest_xdist_make_scheduler(config, log):
  """pytest.ini's `--dist loadfile`, with a worker's crash costing its test, not a hung run."""
  if config.getvalue("dist") == "loadfile":
    return scheduling.CrashSafeLoadFileScheduling(config, log)
  return None


@pytest.fixture(scope="session")
def demo_run() -> str:
  """A 2-step semantic-softmax demo run (vit_demo, tests.helpers.tiny_config), trained once for
  all test files: a real checkpoint that tests read (teachers, predict, meta)."""
  return helpers.shared_run(
      "semantic_softmax_vit_demo_2",
      lambda d: train.train_and_evaluate(helpers.tiny_config(total_steps=2), d))


def pytest_terminal_summary(terminalreporter):
  """One line when interop tests were skipped for want of torch, saying how to run them."""
  skipped = [r for r in terminalreporter.stats.get("skipped", []) if "interop" in r.keywords]
  if skipped:
    terminalreporter.write_line(
        f"{len(skipped)} interop tests skipped: torch/timm are not installed; "
        "pip install -e '.[interop]' runs them.")


@pytest.fixture(scope="session")
def dask_beam():
  """The Beam jobs' Dask runner on a local dask.distributed cluster of two single-threaded
  worker processes, shared by the tests that use it: (runner, Beam options)."""
  distributed = pytest.importorskip("distributed", reason="the beam extra's dask")
  with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                dashboard_address=None) as cluster:
    # Two partitions: every Create is split between the two workers.
    yield ("input_pipeline.jobs.dask_runner.DaskRunner",
           [f"--dask_client_address={cluster.scheduler_address}", "--dask_npartitions=2"])
