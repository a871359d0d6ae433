"""`python -m bigpretrain.main` with a dataset whose label is the record index ('ids:N'), and
each train batch's labels appended to WORKDIR/ids_<process>.jsonl as the trainer takes it:
the records every step trained on (tests/test_topology_resume.py runs it through
launch/local.sh --module=tests.topology_run). TOPOLOGY_RUN_PACE=SECONDS waits that long
before each batch, so that a test's SIGTERM lands mid-run."""
import io
import json
import os
import time

from absl import app
from absl import flags
import grain
import jax
import numpy as np
from PIL import Image

from bigpretrain import main
from bigpretrain import train
from input_pipeline import datasets


class _IdSource(datasets.Source):
  """N records of 8x8 PNGs; record i has label i."""

  def __init__(self, n: int, offset: int = 0):
    self._n, self._offset = n, offset

  def __len__(self):
    return self._n

  def __getitem__(self, i):
    pixels = np.full((8, 8, 3), (self._offset + i) % 256, np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return {"image": buf.getvalue(), "label": int(i)}


class _IdDataset(datasets.Dataset):
  """'ids:N': N train records labelled 0..N-1 (N classes) and 16 validation records."""

  def __init__(self, name, data_dir):
    del data_dir
    n = int(name.split(":")[1])
    self.info = datasets.DatasetInfo(
        name=name, num_classes=n, class_names=[f"c{i}" for i in range(n)],
        num_examples={"train": n, "validation": 16}, image_size=8,
        splits=("train", "validation"), features={"label": 0})

  def source(self, split):
    return _IdSource(self.info.num_examples[split], 0 if split == "train" else 100)


class _Recording(grain.DatasetIterator):
  """Appends the labels of each batch it yields to `path`."""

  def __init__(self, parent, path):
    super().__init__(parent)
    self._path = path

  def __next__(self):
    time.sleep(float(os.environ.get("TOPOLOGY_RUN_PACE", "0")))
    batch = next(self._parent)
    with open(self._path, "a") as f:
      f.write(json.dumps(batch["label"].tolist()) + "\n")
    return batch

  def get_state(self):
    return self._parent.get_state()

  def set_state(self, state):
    self._parent.set_state(state)


datasets.register_source("ids:", _IdDataset)
_make = train.make_train_iterator


def _recording_iterator(exp, position=None):
  workdir = flags.FLAGS.workdir
  path = os.path.join(workdir, f"ids_{jax.process_index()}.jsonl")
  return _Recording(_make(exp, position), path)


train.make_train_iterator = _recording_iterator

if __name__ == "__main__":
  app.run(main.main)
