"""The evaluator contract and the settings every evaluator shares."""
from bigpretrain import registry
from input_pipeline import datasets
from input_pipeline import subset

# Evaluator classes by config.evals.NAME.type; `cls(name, cfg, experiment)` builds one.
EVALUATORS = registry.Registry("evaluator type", "config.evals.*.type")

COMMON_KEYS = ("type", "every_steps", "dataset", "data_dir", "split")


class Evaluator:
  """Runs on the train state every `every_steps` steps (and at the end of the run).

  Common settings: every_steps (-1 or absent: config.eval_every_steps; 0: only at the end),
  dataset ('' or absent: config.data.name) with data_dir (default config.data.dir), and split
  ('' or absent: config.data.eval_split; 'validation[:1000]': a range of its records, as in
  tfds). Subclasses list their own keys in KEYS, and the common keys they do not read (their
  own keys say it) in NOT_READ.
  """
  KEYS: tuple[str, ...] = ()
  NOT_READ: tuple[str, ...] = ()

  def __init__(self, name: str, cfg, exp):
    allowed = set(COMMON_KEYS) - set(self.NOT_READ) | set(self.KEYS)
    unknown = sorted(set(cfg.keys()) - allowed)
    if unknown:
      raise ValueError(f"config.evals.{name} has unknown keys {unknown}; allowed: "
                       f"{sorted(allowed)}.")
    config = exp.config
    self.name = name
    self.cfg = cfg
    every = cfg.get("every_steps", -1)
    self.every_steps = config.eval_every_steps if every == -1 else every
    if not isinstance(self.every_steps, int) or self.every_steps < 0:
      raise ValueError(f"config.evals.{name}.every_steps={every!r} must be an int >= 0, or -1 "
                       "(= config.eval_every_steps).")
    self.dataset = self.split = None  # Set below unless NOT_READ says they are not read.
    if "dataset" in self.NOT_READ:
      return
    self.split = cfg.get("split", "") or config.data.eval_split
    dataset_name = cfg.get("dataset", "") or config.data.name
    data_dir = cfg.get("data_dir", "") or config.data.dir
    if (dataset_name, data_dir) != (config.data.name, config.data.dir):
      self.dataset = datasets.get_dataset({"name": dataset_name, "dir": data_dir})
    else:
      self.dataset = exp.dataset
    subset.check_split(self.dataset.info, self.split, f"config.evals.{name}.split")

  def run(self, state) -> dict:
    """Metrics of `state` ({'params', 'extra', ...}) named '<name>/<metric>'."""
    raise NotImplementedError
