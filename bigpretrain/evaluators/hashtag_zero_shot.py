"""Zero-shot top-1 of a hashtag model during its training (SWAG, Singh et al. 2022, section
4.4): the hashtag softmax mapped onto a WordNet-labelled dataset's classes through WordNet, with
and without transductive Platt scaling (bigpretrain/swag/zero_shot.py; the command
bigpretrain/tools/zero_shot.py does the same for a finished checkpoint)."""
from bigpretrain.swag import zero_shot
from bigpretrain.evaluators import base
from input_pipeline import subset


@base.EVALUATORS.register("zero_shot")
class ZeroShot(base.Evaluator):
  """Settings: dataset (required: WordNet-labelled, e.g. 'demo' or 'tfds:imagenet2012'),
  aggregation ('' = the paper's per model, or one of zero_shot.AGGREGATIONS), platt ('on',
  'off' or 'both'). Logs top1_platt and/or top1_no_platt (and their ReaL top-1 on a dataset
  with ReaL labels)."""
  KEYS = ("aggregation", "platt")

  def __init__(self, name, cfg, exp):
    super().__init__(name, cfg, exp)
    config = exp.config
    hashtags = zero_shot.check_hashtag_model(
        {"objective": dict(config.objective), "dataset": config.data.name,
         "class_names": exp.dataset.info.class_names}, "This run")
    info = self.dataset.info
    wnids = zero_shot.check_wordnet_classes(info.class_names, info.name)
    self.num_real = info.num_classes if zero_shot.REAL_LABEL in info.features else 0
    self.chosen = zero_shot.aggregations(config.model.name, cfg.get("aggregation", ""),
                                         cfg.get("platt", "both"))
    self.exp = exp
    self.step = zero_shot.scores_step(exp.model_def, exp.shardings, exp.mesh,
                                      config.data.normalize, zero_shot.class_map(wnids, hashtags),
                                      sorted(set(self.chosen.values())))

  def run(self, state) -> dict:
    config = self.exp.config
    # The images as the zero-shot command reads them (the paper's evaluation crop).
    data_cfg = zero_shot.eval_data_config(dict(config.data), config.data.get("num_workers", 0))
    source = subset.split_source(self.dataset, self.split)
    rows = zero_shot.collect_scores(self.step, state, source, data_cfg,
                                    batch_size=config.batch_size, mesh=self.exp.mesh,
                                    num_real=self.num_real)
    out = zero_shot.top1_from_rows(rows, self.chosen)
    return {f"{self.name}/{k}": v for k, v in out.items() if v is not None}
