"""The semi-supervised recipe, every stage in one command (Yalniz et al. 2019).

  python -m bigpretrain.tools.semi_supervised --config=configs/semi_supervised.py --workdir=DIR

What it computes and why: bigpretrain/semisup/semi_supervised.py.
"""

import time

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from bigpretrain.runtime import console
from bigpretrain.runtime import distributed
from bigpretrain.runtime import preemption
from bigpretrain.runtime import workdir_lock
from bigpretrain.semisup import semi_supervised
from bigpretrain.tools import cli


def define_flags():
  """The command's flags (defined only when it runs; see bigpretrain/infer.py)."""
  config_flags.DEFINE_config_file("config", None, "configs/semi_supervised.py[:args].",
                                  lock_config=True)
  flags.DEFINE_string("workdir", None, "Folder of all stages (created; resumed if started).")
  distributed.define_flags()


def main(argv):
  cli.check_usage(argv, "config", "workdir")
  f = flags.FLAGS
  distributed.initialize_from_flags()
  with cli.user_errors(workdir_lock.WorkdirUnwritable):
    workdir_lock.check_writable(f.workdir)  # Before the log goes there.
  logging.get_absl_handler().use_absl_log_file("log", f.workdir)
  console.report_log_errors_once(logging.get_absl_handler().python_handler)
  started = time.time()
  with cli.user_errors(*cli.run_errors(), log_traceback=True):
    try:
      semi_supervised.run(f.config, f.workdir)
    except (semi_supervised.Interrupted, preemption.Interrupted) as e:  # Nothing lost.
      print(str(e), flush=True)
      if isinstance(e, preemption.Interrupted):
        preemption.exit_interrupted()
      return
  if semi_supervised.is_main():
    print(f"All stages done in {time.time() - started:.0f} s.", flush=True)


if __name__ == "__main__":
  define_flags()
  app.run(main, flags_parser=cli.parse_flags)
