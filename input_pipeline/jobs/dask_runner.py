"""Beam's Dask runner, fixed for pipelines with several outputs (the preparation jobs).

  python -m input_pipeline.prepare ... --beam_runner=input_pipeline.jobs.dask_runner.DaskRunner \
      --dask_client_address=tcp://SCHEDULER:8786 [--dask_npartitions=N]

apache_beam.runners.dask.dask_runner.DaskRunner translates each Beam transform into a
dask.bag operation, but it keeps one bag per transform and computes only the last one, so:
  - a ParDo's tagged outputs (`.with_outputs(...)`) all reach every consumer, mixed together
    (the jobs route corrupt files and skip reasons to their reports that way);
  - every branch that does not feed the last transform never runs (tfds writes each split in
    its own branch, and the jobs write their reports in another);
and each bundle drops what its DoFn outputs in finish_bundle and computes its side inputs
again itself; its result gathers every output to the client and counts a cancelled one as
done. This runner keeps one bag per PCollection (a tagged output is its ParDo's bag filtered
to that tag), computes every PCollection nothing consumes, keeps finish_bundle's outputs,
gathers each side input once from its bag's own keys for every transform that reads it (so
each PCollection is computed once; dask computes again only what a lost worker held), waits
for the outputs' status without fetching them, fails unless every one finished, and closes
its dask client when the pipeline ends. A bundle run again after a lost worker runs its DoFns
again: the jobs' DoFns are idempotent, and their tests compare the output with the
local runner's. The rest is Beam's runner: its other translations, its options
(`--dask_client_address`, `--dask_npartitions`, ...; without an address it starts a
LocalCluster on this machine) and its limits, e.g. no Beam metrics (the jobs' reports then
carry no counters).
"""
import functools
import time

import dask.bag
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph
from apache_beam import DoFn
from apache_beam import pvalue
from apache_beam.pipeline import PipelineVisitor
from apache_beam.runners.dask import dask_runner
from apache_beam.runners.dask import overrides
from apache_beam.runners.dask import transform_evaluator
from apache_beam.runners.common import DoFnContext
from apache_beam.runners.common import DoFnInvoker
from apache_beam.runners.common import DoFnSignature
from apache_beam.runners.common import _OutputHandler
from apache_beam.runners.runner import PipelineState
from apache_beam.transforms import sideinputs


def _bundle(items, invoker_args, invoker_kwargs, receivers, side_specs, **side_values):
  """transform_evaluator.apply_dofn_to_bundle, but each side input arrives computed (its
  elements, side_values['side_<i>']) instead of being computed inside the bundle, a tagged output
  stays a TaggedOutput, and what finish_bundle outputs (e.g. WriteToText's files) is kept."""
  side_inputs = [
      sideinputs.SideInputMap(view, options, [
          transform_evaluator.get_windowed_value(x, window_mapping_fn)
          for x in side_values[f"side_{i}"]])
      for i, (view, options, window_mapping_fn) in enumerate(side_specs)]
  invoker = DoFnInvoker.create_invoker(*invoker_args, side_inputs=side_inputs, **invoker_kwargs)
  invoker.invoke_setup()
  invoker.invoke_start_bundle()
  for item in items:
    invoker.invoke_process(item)
  invoker.invoke_finish_bundle()
  invoker.invoke_teardown()
  return [pvalue.TaggedOutput(v.tag, v.value) if isinstance(v, pvalue.TaggedOutput)
          else v.value for v in receivers.values]


def _concat(partitions) -> list:
  return [x for partition in partitions for x in partition]


def _identity(x):
  return x


def _broadcast(bag, npartitions: int):
  """A bag of `npartitions` partitions, each the whole of `bag` as one list: a side input,
  gathered once (one task over `bag`'s own keys) for every transform that reads it.

  Not `dask.delayed(list)(bag)`: dask hands a collection passed as an argument a copy of its
  whole graph under fresh keys, so each side input recomputed everything upstream of it, and
  side inputs of side inputs again within each copy (the hashtag job read each input file
  more than a hundred times)."""
  token = tokenize(bag.name, bag.npartitions, npartitions)
  name, whole = f"side-input-{token}", f"side-input-whole-{token}"
  layer = {whole: (_concat, [(bag.name, i) for i in range(bag.npartitions)])}
  layer.update({(name, n): (_identity, whole) for n in range(npartitions)})
  return dask.bag.Bag(HighLevelGraph.from_collections(name, layer, dependencies=[bag]), name,
                      npartitions)


class _ParDo(transform_evaluator.ParDo):
  """Beam's ParDo translation with _bundle. side_inputs: (view class, view options, window
  mapping fn, bag) of each side input."""

  def apply(self, input_bag, side_inputs=None):
    transform = self.transform
    args, kwargs = transform.raw_side_inputs
    main_input = next(iter(self.applied.main_inputs.values()))
    window_fn = getattr(main_input, "windowing", None)
    window_fn = window_fn.windowfn if window_fn else None
    receivers = transform_evaluator.OneReceiver()
    invoker_args = [
        DoFnSignature(transform.fn),
        _OutputHandler(window_fn=window_fn, main_receivers=receivers[None],
                       tagged_receivers=receivers, per_element_output_counter=None,
                       output_batch_converter=None, process_yields_batches=False,
                       process_batch_yields_elements=False)]
    invoker_kwargs = dict(context=DoFnContext(transform.label, state=None),
                          input_args=list(args), input_kwargs=kwargs, user_state_context=None,
                          bundle_finalizer_param=DoFn.BundleFinalizerParam())
    side_inputs = side_inputs or []
    side_specs = [spec[:3] for spec in side_inputs]
    side_values = {f"side_{i}": _broadcast(spec[3], input_bag.npartitions)
                   for i, spec in enumerate(side_inputs)}
    return input_bag.map(transform_evaluator.get_windowed_value, window_fn).map_partitions(
        _bundle, invoker_args, invoker_kwargs, receivers, side_specs, **side_values)


def _has_tag(tag, item) -> bool:
  return (item.tag if isinstance(item, pvalue.TaggedOutput) else None) == tag


class _BagPerPCollection(PipelineVisitor):
  """Translates leaf transforms into dask bags, one per output PCollection."""

  def __init__(self, bag_kwargs):
    self.bags = {}  # PCollection -> dask bag (None for PBegin-like outputs).
    self.terminal_bags = []  # Bags of transforms without outputs.
    self.consumed = set()
    self._bag_kwargs = bag_kwargs

  def visit_transform(self, transform_node) -> None:
    outputs = list(transform_node.outputs.values())
    op_class = transform_evaluator.TRANSLATIONS.get(transform_node.transform.__class__,
                                                    transform_evaluator.NoOp)
    if op_class is transform_evaluator.ParDo:
      op_class = _ParDo
    tagged = len(outputs) > 1 and op_class is _ParDo
    op = op_class(transform_node, bag_kwargs=self._bag_kwargs)
    inputs = []
    for value in transform_node.inputs:
      self.consumed.add(value)
      if isinstance(value, pvalue.PBegin):
        inputs.append(None)
      elif value in self.bags:
        inputs.append(self.bags[value])
    if isinstance(op, transform_evaluator.Flatten):
      input_bag = inputs
    else:
      input_bag = inputs[0] if len(inputs) == 1 else (inputs or None)
    side_inputs = None
    if transform_node.side_inputs:
      side_inputs = []
      for si in transform_node.side_inputs:
        self.consumed.add(si.pvalue)
        side_inputs.append((type(si), si._view_options(), si._window_mapping_fn,  # pylint: disable=protected-access
                            self.bags[si.pvalue]))
    bag = op.apply(input_bag=input_bag, side_inputs=side_inputs)
    if not outputs and bag is not None:
      self.terminal_bags.append(bag)
    for output in outputs:
      if tagged and bag is not None:
        self.bags[output] = bag.filter(functools.partial(_has_tag, output.tag))
      else:
        self.bags[output] = bag

  def leaves(self) -> list:
    """The bags nothing consumes: computing them runs the whole pipeline."""
    unused = [bag for pcoll, bag in self.bags.items() if pcoll not in self.consumed]
    return [bag for bag in unused + self.terminal_bags if bag is not None]


class DaskRunnerResult(dask_runner.DaskRunnerResult):
  """Beam's result, waiting for the pipeline's outputs without fetching them, failing unless
  every one finished, and closing the client once the pipeline has ended.

  Beam's own wait gathers every output to the client and passes over cancelled ones: a
  pipeline whose tasks dask cancelled (e.g. "lost dependencies") counted as done with nothing
  computed, and after a lost worker the gather could wait for ever on outputs the scheduler
  held. The outputs are the jobs' files; what the client needs is each task's status."""

  def wait_until_finish(self, duration=None) -> str:
    if self._state in (PipelineState.DONE, PipelineState.FAILED):
      return self._state
    deadline = None if duration is None else time.monotonic() + duration / 1000
    try:
      for future in self.futures:
        # Waits on this future's own client until the task has ended; fetches nothing.
        future.exception(timeout=None if deadline is None else
                         max(0.0, deadline - time.monotonic()))
        if future.status != "finished":
          future.result()  # Raises the task's own error, or why dask cancelled it.
      self._state = PipelineState.DONE
    except BaseException:
      self._state = PipelineState.FAILED
      raise
    finally:
      if self._state in (PipelineState.DONE, PipelineState.FAILED):
        self.client.close()
    return self._state


class DaskRunner(dask_runner.DaskRunner):
  """Beam's DaskRunner computing every output of the pipeline, tagged outputs kept apart."""

  def run_pipeline(self, pipeline, options):
    from dask import distributed  # pylint: disable=g-import-not-at-top
    dask_options = options.view_as(dask_runner.DaskOptions).get_all_options(
        drop_default=True, current_only=True)
    bag_kwargs = dask_runner.DaskOptions._extract_bag_kwargs(dask_options)  # pylint: disable=protected-access
    client = distributed.Client(**dask_options)
    pipeline.replace_all(overrides.dask_overrides())
    visitor = _BagPerPCollection(bag_kwargs)
    pipeline.visit(visitor)
    # Unoptimised: with dask's graph optimisation (fusion) the jobs' reports missed elements
    # of side inputs built from tagged outputs and Flattens.
    futures = client.compute(visitor.leaves(), optimize_graph=False)
    return DaskRunnerResult(client, futures)
