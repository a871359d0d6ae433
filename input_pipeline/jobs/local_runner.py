"""The runner of a Beam job when none is named: Beam's FnApiRunner.

Beam's DirectRunner first tries its Prism runner, whose binary it downloads from GitHub on a
machine that lacks it: with no network that answers, a wait as long as the connection's
timeout before it falls back; with one, the jobs run on a runner their tests never use. The
FnApiRunner is the one it falls back to for these batch jobs, the one the tests run, and the
one --direct_num_workers and --direct_running_mode=multi_processing configure.
"""
from apache_beam.runners.portability.fn_api_runner import fn_runner


def runner_or_local(beam_runner):
  """`beam_runner` (a name or a runner object) if given, else a new FnApiRunner."""
  return beam_runner or fn_runner.FnApiRunner()
