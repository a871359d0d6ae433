"""The few-shot probe every recipe carries (big_vision's configs/common_fewshot.py habit):
`config.evals.fewshot`, a k-shot ridge classifier on frozen pooled features
(bigpretrain/evaluators/fewshot.py), logged as 'fewshot/<dataset>_<k>shot' every
eval_every_steps. It tells early whether pretraining helps transfer.

On the demo it probes demo validation from draws of demo train (1/5/10/25 shots, 3 seeds;
every_steps -1 = eval_every_steps), the pool cut to the first DEMO_POOL train records (stored
shuffled) so that a probe costs a few seconds; `--config.evals.fewshot.shots='()'` turns it
off. At paper scale the entry has no datasets (it logs nothing) until prepared
downstream sets are named, e.g. in a config
  config.evals.fewshot.datasets = {'cifar100': ('tfds:cifar100', 'train', 'test'),
                                   'pets': ('tfds:oxford_iiit_pet', 'train', 'test')}
(big_vision's usual probes); probing the 21k pretraining set itself would cost a pass over
hundreds of thousands of images per probe.
"""
import ml_collections

from bigpretrain.evaluators import linear_probe

DEMO_POOL = 5000  # 50 records per demo class on average; the 25-shot draw needs 25.
# The demo's 128-d features: big_vision's 2^10 (for the 768-d and wider features of real
# models) shrinks so hard that accuracy stops rising with shots (demo_coarse from the seed-0
# semantic-softmax demo, 3 seeds, 1/5/10/25 shots: 0.275/0.247/0.239/0.242 at 2^10,
# 0.288/0.302/0.331/0.361 at 1). 1 was picked on that run from {2^-5, 1, 2^5, 2^10}.
DEMO_L2_REG = 1.0


def add(config: ml_collections.ConfigDict, demo: bool,
        dataset: str = "demo") -> ml_collections.ConfigDict:
  """Adds config.evals.fewshot (demo: probing the demo `dataset`'s validation, logged as
  'demo'; else: no datasets yet)."""
  if demo:
    datasets = {"demo": (dataset, "train", "validation")}
    pool, l2 = DEMO_POOL, DEMO_L2_REG
  else:
    datasets, pool, l2 = {}, 0, linear_probe.L2_REG
  config.evals.fewshot = ml_collections.ConfigDict(dict(
      type="fewshot", every_steps=-1, datasets=datasets, shots=(1, 5, 10, 25), seeds=3,
      train_records=pool, l2_reg=l2))
  return config
