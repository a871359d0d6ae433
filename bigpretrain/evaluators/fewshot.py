"""Transfer probes on frozen features during (or instead of) training: `fewshot` (k-shot
ridge regression, big_vision's few-shot evaluator) and `linear` (a classifier on a whole
train split: the same closed-form ridge by default, or `classifier='logistic'`, L-BFGS
logistic regression). The math is in bigpretrain/evaluators/linear_probe.py.

  config.evals.fewshot = dict(type='fewshot', datasets={'demo': ('demo', 'train',
      'validation')}, shots=(1, 5, 10, 25), seeds=3)
logs 'fewshot/<label>_<k>shot': the test-split accuracy of the k-shot classifier, mean over
the seeds. Only the drawn train records and the test split go through the model. Empty
datasets or shots (`--config.evals.fewshot.shots='()'`) turn it off.
"""
import numpy as np

from bigpretrain.evaluators import linear_probe
from bigpretrain.evaluators import base
from input_pipeline import datasets
from input_pipeline import subset


def _ints(value, what: str, minimum: int) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"{what}={value!r} must be an int >= {minimum}.")


class _Probe:
  """One dataset's train pool and test split, their labels read once."""

  def __init__(self, where: str, name: str, data_dir: str, train_split: str,
               test_split: str, train_records: int):
    self.dataset = datasets.get_dataset({"name": name, "dir": data_dir})
    info = self.dataset.info
    for split in (train_split, test_split):
      subset.check_split(info, split, where)
    self.num_classes = info.num_classes
    pool = subset.split_source(self.dataset, train_split)
    if train_records:  # tfds stores records shuffled: a prefix is a random sample.
      pool = subset.RangeSource(pool, 0, min(train_records, len(pool)))
    self.pool, self.test = pool, subset.split_source(self.dataset, test_split)
    self.y_pool, self.y_test = subset.labels(self.pool), subset.labels(self.test)


@base.EVALUATORS.register("fewshot")
class FewShot(base.Evaluator):
  """Settings: datasets ({label: (dataset name, train split, test split)}; data_dir is
  shared), shots (DEFAULT_SHOTS), seeds (3), l2_reg (fewshot.L2_REG), train_records (0: the
  whole train split is the pool; N: its first N records, a cheaper pool)."""
  KEYS = ("datasets", "shots", "seeds", "l2_reg", "train_records")
  NOT_READ = ("dataset", "split")  # Each entry of `datasets` names both.

  def __init__(self, name, cfg, exp):
    super().__init__(name, cfg, exp)
    where = f"config.evals.{name}"
    self.shots = tuple(cfg.get("shots", linear_probe.DEFAULT_SHOTS))
    self.seeds = cfg.get("seeds", linear_probe.DEFAULT_SEEDS)
    self.l2 = float(cfg.get("l2_reg", linear_probe.L2_REG))
    train_records = cfg.get("train_records", 0)
    for k in self.shots:
      _ints(k, f"{where}.shots entry", 1)
    _ints(self.seeds, f"{where}.seeds", 1)
    _ints(train_records, f"{where}.train_records", 0)
    if not self.l2 > 0:
      raise ValueError(f"{where}.l2_reg={self.l2} must be > 0.")
    data_dir = cfg.get("data_dir", "") or exp.config.data.dir
    self.probes = {}
    # No shots (--config.evals.fewshot.shots='()') or no datasets: the probe is off.
    probed = dict(cfg.get("datasets", {})) if self.shots else {}
    for label, spec in sorted(probed.items()):
      if not isinstance(spec, (tuple, list)) or len(spec) != 3:
        raise ValueError(f"{where}.datasets.{label}={spec!r} must be (dataset name, train "
                         "split, test split).")
      probe = _Probe(f"{where}.datasets.{label}", spec[0], data_dir, spec[1], spec[2],
                     train_records)
      try:  # Fails early when a class has fewer records than the largest k.
        probe.drawn = linear_probe.drawn_indices(probe.y_pool, probe.num_classes, self.shots,
                                            self.seeds)
      except ValueError as e:
        raise ValueError(f"{where}.datasets.{label} ({spec[0]}:{spec[1]}): {e}") from None
      self.probes[label] = probe
    self.exp = exp
    linear_probe.check_model(exp.model_def, where)
    self.step = linear_probe.make_features_step(exp.model_def, exp.shardings, exp.mesh,
                                           exp.config.data.normalize)

  def _features(self, state, source):
    config = self.exp.config
    return linear_probe.features(self.step, state, source, config.data,
                            batch_size=config.batch_size, mesh=self.exp.mesh)

  def run(self, state) -> dict:
    results = {}
    for label, p in self.probes.items():
      x_drawn = self._features(state, subset.SubsetSource(p.pool, p.drawn))
      x_test = self._features(state, p.test)
      accs = linear_probe.fewshot_accuracies(x_drawn, p.drawn, p.y_pool, x_test, p.y_test,
                                        p.num_classes, shots=self.shots, seeds=self.seeds,
                                        l2=self.l2)
      results.update({f"{self.name}/{label}_{k}shot": v for k, v in accs.items()})
    return results


@base.EVALUATORS.register("linear")
class Linear(base.Evaluator):
  """A linear classifier on the features of a whole train split, scored on `split`.
  Settings: classifier (linear_probe.CLASSIFIERS: 'ridge', closed form, the default; or
  'logistic'), train_split (config.data.train_split), l2_reg (the classifier's default),
  train_records (0: the whole split; N: its first N records). Logs '<name>/top1' and
  '<name>/num_train'. Keeps the train features in host memory (N x D float32)."""
  KEYS = ("classifier", "train_split", "l2_reg", "train_records")

  def __init__(self, name, cfg, exp):
    super().__init__(name, cfg, exp)
    where = f"config.evals.{name}"
    self.classifier = str(cfg.get("classifier", "ridge"))
    default_l2 = linear_probe.CLASSIFIERS.get(self.classifier).default_l2
    self.l2 = float(cfg.get("l2_reg", default_l2))
    if not self.l2 > 0:
      raise ValueError(f"{where}.l2_reg={self.l2} must be > 0.")
    train_split = cfg.get("train_split", "") or exp.config.data.train_split
    train_records = cfg.get("train_records", 0)
    _ints(train_records, f"{where}.train_records", 0)
    info = self.dataset.info
    self.probe = _Probe(where, info.name, cfg.get("data_dir", "") or exp.config.data.dir,
                        train_split, self.split, train_records)
    self.exp = exp
    linear_probe.check_model(exp.model_def, where)
    self.step = linear_probe.make_features_step(exp.model_def, exp.shardings, exp.mesh,
                                           exp.config.data.normalize)

  def run(self, state) -> dict:
    config, p = self.exp.config, self.probe
    kw = dict(batch_size=config.batch_size, mesh=self.exp.mesh)
    x_train = linear_probe.features(self.step, state, p.pool, config.data, **kw)
    x_test = linear_probe.features(self.step, state, p.test, config.data, **kw)
    acc = linear_probe.accuracy(x_train, p.y_pool, x_test, p.y_test, p.num_classes,
                                classifier=self.classifier, l2=self.l2)
    return {f"{self.name}/top1": acc, f"{self.name}/num_train": float(len(x_train))}
