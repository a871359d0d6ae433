"""The few-shot probe every recipe carries (big_vision's configs/common_fewshot.py habit):
`config.evals.fewshot`, a k-shot ridge classifier on frozen pooled features
(bigpretrain/evaluators/fewshot.py), logged as 'fewshot/<dataset>_<k>shot' every
eval_every_steps. It tells early whether pretraining helps transfer.

On the demo it probes demo validation from draws of demo train (1/5/10/25 shots, 3 seeds; every_steps -1 = eval_every_steps),
the pool cut to the first DEMO_POOL train records (stored shuffled) so that a probe costs a
few seconds. At paper scale the entry has no datasets (it logs nothing) until prepared
downstream sets are named, e.g. in a config
  config.evals.fewshot.datasets = {'cifar100': ('tfds:cifar100', 'train', 'test'),
                                   'pets': ('tfds:oxford_iiit_pet', 'train', 'test')}
(big_vision's usual probes); probing the 21k pretraining set itself would cost a pass over
hundreds of thousands of images per probe.
"""
import ml_collections

DEMO_POOL = 5000  # 50 records per demo class on average; the 25-shot draw needs 25.


def add(config: ml_collections.ConfigDict, demo: bool) -> ml_collections.ConfigDict:
  """Adds config.evals.fewshot (demo: probing demo validation; else: no datasets yet)."""
  if demo:
    datasets = {"demo": ("demo", "train", "validation")}
    pool = DEMO_POOL
  else:
    datasets, pool = {}, 0
  config.evals.fewshot = ml_collections.ConfigDict(dict(
      type="fewshot", every_steps=-1, datasets=datasets, shots=(1, 5, 10, 25), seeds=3,
      train_records=pool))
  return config
