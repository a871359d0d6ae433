"""Where the train stream stands in its global record order, so that a run resumes on another
topology (process count or grain workers per process) without repeating or skipping records.

The train stream (pipeline.mixed_train_iterator) is one global sequence: global position g
holds a record (shuffled, repeated, mixed) augmented with a generator from (seed, g). Host p
of P reads positions p, p + P, ...; with W grain workers (mp_prefetch), worker w of a host
reads that host's positions w, w + W, ... and the host's batches take the workers in turn.
grain's iterator state is one JSON per process ('next_index' per worker), valid only for the
same P and W. With another P or W the run continues from a `Position` instead: `start`, the
first global position that some worker had not yet read, and `consumed`, the positions after
it that other workers had already read (at most about a batch per worker: the round robin
over workers, and hosts that skipped corrupt records, run ahead). The continued stream reads
the positions >= start that are not in `consumed`, in order, and deals them out to the new
hosts and workers as above. Records of a batch cut by a topology change therefore land in
other batches, never twice, never lost.
"""
import dataclasses
import gc
import json
import sys
from typing import Any, Callable, Mapping, Sequence

import grain
import numpy as np


@dataclasses.dataclass(frozen=True)
class Position:
  """The remaining stream: global positions >= start, except those in `consumed` (sorted)."""
  start: int = 0
  consumed: tuple[int, ...] = ()

  def __post_init__(self):
    c = np.asarray(self.consumed, np.int64)
    if self.start < 0 or (c.size and (c[0] < self.start or np.any(np.diff(c) <= 0))):
      raise ValueError(f"bad stream position: start {self.start}, consumed {self.consumed[:8]}"
                       "... must be >= start, sorted and distinct")
    object.__setattr__(self, "_before", c - self.start - np.arange(len(c)))

  @property
  def at_start(self) -> bool:
    return self.start == 0 and not self.consumed

  def global_index(self, q):
    """Global position of the q-th remaining record (int or int array).

    With d_i = consumed[i] - start - i (remaining records before consumed[i]), consumed[i]
    precedes the q-th remaining record iff d_i <= q."""
    out = self.start + np.asarray(q, np.int64) + np.searchsorted(self._before, q, side="right")
    return int(out) if np.ndim(out) == 0 else out

  def to_json(self) -> dict:
    return {"start": int(self.start), "consumed": [int(c) for c in self.consumed]}

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> "Position":
    return cls(int(d["start"]), tuple(int(c) for c in d["consumed"]))


class ContinuedStream(grain.MapDataset):
  """The remaining records of an infinite global stream: [q] is parent[position.global_index(q)].
  Sits after the per-record augmentation, so a record keeps its global position's generator."""

  def __init__(self, parent: grain.MapDataset, position: Position):
    super().__init__(parent)
    self._position = position

  def __len__(self) -> int:
    return sys.maxsize

  def __getitem__(self, q):
    if isinstance(q, slice):
      return self.slice(q)
    return self._parent[self._position.global_index(int(q))]


def worker_next_indices(state: Mapping[str, Any]) -> list[int]:
  """Per-worker count of the host positions read, from one process's grain iterator state:
  [next_index] without workers, else one entry per worker (in worker order)."""
  if "next_index" in state:
    return [int(state["next_index"])]
  if "iterators_in_use_states" in state:
    order = state.get("iterators_in_use_indices", range(len(state["iterators_in_use_states"])))
    counts = dict(zip(order, (int(s["next_index"]) for s in state["iterators_in_use_states"])))
    if sorted(counts) != list(range(len(counts))):
      raise ValueError(f"grain iterator state names workers {sorted(counts)}, expected 0..W-1")
    return [counts[w] for w in range(len(counts))]
  raise ValueError(f"unrecognised grain iterator state (keys {sorted(state)}); it was not "
                   "written by pipeline.train_iterator")


def num_workers_of(state: Mapping[str, Any]) -> int:
  """data.num_workers of the iterator that wrote `state` (0 = no worker processes)."""
  return 0 if "next_index" in state else len(worker_next_indices(state))


def continue_from(states: Sequence[Mapping[str, Any]], previous: Position = Position()
                  ) -> Position:
  """The Position after the records that P processes (states[p] = process p's grain state)
  had read from the stream `previous` describes, in global positions."""
  P = len(states)
  if P < 1:
    raise ValueError("no grain iterator states to continue from")
  reads = [worker_next_indices(s) for s in states]
  # Substream (p, w) read the remaining-stream indices p + P * (w + W * j) for j < n.
  subs = [(p + P * w, P * len(counts), n) for p, counts in enumerate(reads)
          for w, n in enumerate(counts)]
  q0 = min(first + stride * n for first, stride, n in subs)  # Everything before was read.
  ahead = [first + stride * np.arange(max(0, -(-(q0 - first) // stride)), n, dtype=np.int64)
           for first, stride, n in subs]
  ahead = np.concatenate(ahead) if ahead else np.zeros((0,), np.int64)
  start = previous.global_index(q0)
  older = np.asarray([c for c in previous.consumed if c >= start], np.int64)
  consumed = np.union1d(np.asarray(previous.global_index(ahead), np.int64), older)
  return Position(start, tuple(int(c) for c in consumed))


class StreamChanged(ValueError):
  """A checkpoint's stream position counts records of train data of other sizes."""


def check_records(records: Mapping[str, int], saved: Mapping[str, int] | None, where: str,
                  allow_other_records: bool) -> str | None:
  """Raises StreamChanged when a source's size in `records` (name -> records of its train
  split) differs from `saved`, the sizes the stream at `where` (a checkpoint) was saved with;
  with allow_other_records, returns the warning to give instead. Sources only one side knows
  are not compared (checkpoints from before sizes were kept)."""
  changed = [f"{name}: {saved[name]} records in the checkpoint's stream, {n} now"
             for name, n in records.items() if name in (saved or {}) and saved[name] != n]
  if not changed:
    return None
  text = (f"the train data changed since {where} was saved ({'; '.join(changed)}). Its "
          "stream position counts records in the shuffle order of the old sizes, so "
          "resuming would repeat some records and skip others")
  if not allow_other_records:
    raise StreamChanged(f"{text}. Nothing was changed. Restore the data the run started "
                        "with, use another --workdir, or set "
                        "--config.allow_schedule_change=True to continue anyway.")
  return f"{text}; continuing (config.allow_schedule_change)."


class TrainStream:
  """This host's train iterator with the Position its stream starts from; `restart` rebuilds
  it from another Position (a checkpoint's). `make(position)` builds the iterator.

  `records` (name -> records of its train split) is what a Position counts records of: the
  shuffle order of each source depends on its size, so a position saved over a split of
  another size points at other records. `check_records` refuses such a checkpoint unless
  `allow_other_records` (config.allow_schedule_change)."""

  def __init__(self, make: Callable[[Position], grain.DatasetIterator], num_workers: int,
               position: Position = Position(), records: Mapping[str, int] | None = None,
               allow_other_records: bool = False):
    self._make = make
    self.num_workers = num_workers
    self.position = position
    self.records = dict(records or {})
    self.allow_other_records = allow_other_records
    self.iterator = make(position)

  def check_records(self, saved: Mapping[str, int] | None, where: str) -> str | None:
    """check_records(self.records, saved, where, self.allow_other_records)."""
    return check_records(self.records, saved, where, self.allow_other_records)

  def restart(self, position: Position, rebuild: bool = False) -> None:
    """Continues from `position`; the iterator is rebuilt when the position changes or with
    `rebuild` (e.g. after a failed checkpoint restore may have set its state)."""
    if rebuild or position != self.position:
      self.close()
      self.iterator = self._make(position)
      self.position = position

  def close(self) -> None:
    """Stops the iterator's worker processes and frees the batches they had prepared, and
    those it handed out that nothing holds any more: on the host platform a batch's device
    arrays share its shared memory and are freed by the cyclic collector, and one still
    waiting for a collection when the process ends is never unlinked (reported at exit as
    'leaked shared_memory objects')."""
    self.iterator.close()
    gc.collect()

  def __next__(self):
    return next(self.iterator)

  def __iter__(self):
    return self


def read_states(directory, process_count: int) -> list[dict]:
  """The grain states `process_<p>-of-<P>.json` of a checkpoint's 'data' item, p = 0..P-1."""
  states = []
  for p in range(process_count):
    path = f"{directory}/process_{p}-of-{process_count}.json"
    with open(path) as f:
      states.append(json.load(f))
  return states
