"""Entry point: `python -m bigpretrain.main --config=configs/<recipe>.py[:args] --workdir=DIR`."""
import io
import logging as std_logging
import os
import sys
import tempfile

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from bigpretrain.tools import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Recipe config file (and :args).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run folder: checkpoints, metrics.jsonl, "
                               "TensorBoard events. A fresh temp folder when unset.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Total number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
flags.mark_flags_as_required(["config"])


def main(argv):
  cli.check_usage(argv)
  # JAX probes every platform it knows and logs each one missing ("Unable to initialize
  # backend 'tpu'"): nothing a user can act on. Its warnings and errors still show.
  std_logging.getLogger("jax._src.xla_bridge").setLevel(std_logging.WARNING)
  # Imported here so that jax sees XLA_FLAGS and the flags above first.
  from bigpretrain import train  # pylint: disable=import-outside-toplevel
  from bigpretrain.runtime import console  # pylint: disable=import-outside-toplevel
  from bigpretrain.runtime import distributed  # pylint: disable=import-outside-toplevel
  from bigpretrain.runtime import preemption  # pylint: disable=import-outside-toplevel
  from bigpretrain.runtime import workdir_lock  # pylint: disable=import-outside-toplevel
  workdir = _WORKDIR.value
  # The log goes to the workdir once the run holds it (a refused run leaves the log of the run
  # there alone); what is logged before is kept until then.
  handler = logging.get_absl_handler()
  early = handler.python_handler.stream = io.StringIO()

  def log_to_workdir():
    handler.use_absl_log_file("log", workdir)
    console.report_log_errors_once(handler.python_handler)
    handler.python_handler.stream.write(early.getvalue())

  try:
    if workdir:
      workdir_lock.check_writable(workdir)  # Before anything is built, locked or saved.
    elif _COORDINATOR.value or distributed.detect()[0] != "single":
      raise ValueError("--workdir is required for a run of several processes: each would "
                       "write to a temporary folder of its own.")
    distributed.maybe_initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    if not workdir:
      workdir = tempfile.mkdtemp(prefix="bigpretrain_")
      print(f"--workdir not given: writing to {workdir}", flush=True)
    train.train_and_evaluate(_CONFIG.value, workdir, on_locked=log_to_workdir)
  except preemption.Interrupted as e:
    print(str(e), file=sys.stderr, flush=True)
    preemption.exit_interrupted()
  except cli.USER_ERRORS + cli.run_errors() as e:
    # Configuration and data errors: one clear line, not a traceback through jit.
    _stop(str(e))
  except (OSError, RuntimeError) as e:  # A full file system that no error above names.
    full = cli.no_space(e, workdir or tempfile.gettempdir())
    if full is None:
      raise
    _stop(full)


def _stop(message: str) -> None:
  """`ERROR: message` on a line of its own (a progress bar may be mid-line on the terminal)
  and exit status 1, inside the except block (its traceback goes to the log)."""
  import jax  # pylint: disable=import-outside-toplevel
  logging.exception("Run failed")
  sys.stdout.flush()
  print(f"\nERROR: {message}", file=sys.stderr, flush=True)
  if jax.distributed.is_initialized():
    # A process that stops alone would wait at the runtime's shutdown barrier for peers
    # still in the step (minutes, then every process aborts): leave at once; the others
    # stop when they miss it (the launchers stop them sooner).
    logging.flush()
    os._exit(1)  # pylint: disable=protected-access
  sys.exit(1)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
