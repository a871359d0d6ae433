"""input_pipeline/jobs/dask_runner.py on a local dask cluster of two worker processes: each
PCollection is computed once, side inputs of side inputs included, and a pipeline whose
outputs did not all finish fails instead of counting as done."""
import json
import os
import pathlib
import time
import uuid

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
import pytest

from input_pipeline.jobs import dask_runner

pytestmark = pytest.mark.beam


class _Mark(beam.DoFn):
  """Passes each element on and leaves one file per call in `folder` (workers are other
  processes: files are how they report back)."""

  def __init__(self, folder: str):
    self._folder = folder

  def process(self, x):
    pathlib.Path(self._folder, f"{x}-{uuid.uuid4().hex}").touch()
    yield x


def _write(value, path: str):
  pathlib.Path(path).write_text(json.dumps(value))


def test_each_element_is_read_once_through_side_inputs_of_side_inputs(tmp_path, dask_beam):
  runner, options = dask_beam
  marks = tmp_path / "marks"
  marks.mkdir()
  with beam.Pipeline(runner=runner, options=PipelineOptions(options)) as p:
    numbers = p | beam.Create(list(range(6))) | beam.ParDo(_Mark(str(marks)))
    total = beam.pvalue.AsSingleton(numbers | "Total" >> beam.CombineGlobally(sum))
    scaled = numbers | "Scale" >> beam.Map(lambda x, t: x * t, total)
    largest = beam.pvalue.AsSingleton(scaled | "Largest" >> beam.CombineGlobally(max))
    _ = (p | "Seed" >> beam.Create([None])
         | "Both" >> beam.Map(lambda _, m, t: [m, t], largest, total)
         | "Write" >> beam.Map(_write, str(tmp_path / "out.json")))
  assert json.loads((tmp_path / "out.json").read_text()) == [5 * 15, 15]
  # One call per element. Dask gives a collection passed as an argument a copy of its graph
  # under new keys: with the side inputs passed that way, each element was read 3 times here.
  assert sorted(int(f.name.split("-")[0]) for f in marks.iterdir()) == list(range(6))


def _sleep(seconds):
  time.sleep(seconds)
  return seconds


def test_a_cancelled_output_fails_the_pipeline(dask_beam):
  distributed = pytest.importorskip("distributed")
  _, options = dask_beam
  address = options[0].split("=", 1)[1]
  client = distributed.Client(address)
  done = client.submit(_sleep, 0, pure=False)
  # A task no worker may run: it never starts, so cancelling it keeps no worker busy.
  cancelled = client.submit(_sleep, 0, pure=False, workers=["tcp://127.0.0.1:1"],
                            allow_other_workers=False)
  done.result()
  cancelled.cancel(reason="lost dependencies")
  result = dask_runner.DaskRunnerResult(client, [done, cancelled])
  # Beam's own result passes over a cancelled output and reports the pipeline done.
  with pytest.raises(distributed.client.FutureCancelledError, match="lost dependencies"):
    result.wait_until_finish()
  assert result.state == beam.runners.runner.PipelineState.FAILED
  assert client.status == "closed"


def test_a_worker_killed_in_a_bundle_is_replaced_and_the_pipeline_finishes(tmp_path, dask_beam):
  runner, options = dask_beam
  first = tmp_path / "first_call"

  def kill_the_first_caller(x):
    try:
      os.close(os.open(first, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
      return x
    os.kill(os.getpid(), 9)  # The worker process dies; dask reruns the bundle elsewhere.

  p = beam.Pipeline(runner=runner, options=PipelineOptions(options))
  numbers = p | beam.Create(list(range(8))) | beam.Map(kill_the_first_caller)
  total = beam.pvalue.AsSingleton(numbers | "Total" >> beam.CombineGlobally(sum))
  _ = (p | "Seed" >> beam.Create([None]) | "Read" >> beam.Map(lambda _, t: t, total)
       | "Write" >> beam.Map(_write, str(tmp_path / "out.json")))
  # A time limit, so that a wait that never ends fails the test instead of the suite.
  assert p.run().wait_until_finish(duration=120_000) == "DONE"
  assert first.exists()
  assert json.loads((tmp_path / "out.json").read_text()) == 28
