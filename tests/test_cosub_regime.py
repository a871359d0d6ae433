"""configs/cosub_in21k.py:regime=long, the demo setting where cosub's regularisation matters."""
import math

import pytest

from bigpretrain import config_lib
from configs import cosub_in21k

pytestmark = pytest.mark.slow  # end-to-end recipe runs


def _flat(config, prefix=""):
  out = {}
  for key, value in config.items():
    if hasattr(value, "items"):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def _diff(a, b):
  fa, fb = _flat(a), _flat(b)
  assert fa.keys() == fb.keys()
  return {k: (fa[k], fb[k]) for k in fa if fa[k] != fb[k]}


def test_long_regime_sets_the_documented_subset_length_and_tau():
  short, long = cosub_in21k.get_config(), cosub_in21k.get_config("regime=long")
  assert cosub_in21k.get_config("regime=short").to_dict() == short.to_dict()
  # Only the subset, the length and tau (+0.05, A.1's rule for long schedules) change.
  assert _diff(short, long) == {
      "data.subset_frac": (1.0, 0.1), "total_steps": (400, -1), "num_epochs": (-1.0, 30.0),
      "model.drop_path_rate": (0.5, 0.55)}
  assert long.data.subset_seed == 0  # The same 10% draw for every --config.seed.
  config_lib.validate(long)
  # 30 epochs of the 2,009 drawn records (10% of each class's count, rounded) at batch 128.
  assert config_lib.resolve_total_steps(long, 2009) == math.ceil(30 * 2009 / 128) == 471
  assert cosub_in21k.get_config("regime=long,tau=0.3").model.drop_path_rate == 0.3


def test_long_regime_without_cosub_changes_only_num_submodels():
  cosub = cosub_in21k.get_config("regime=long")
  base = cosub_in21k.get_config("regime=long,submodels=1")
  assert cosub.objective.num_submodels == 2
  assert _diff(cosub, base) == {"objective.num_submodels": (2, 1)}
  # The command-line form of the baseline gives the same config.
  override = cosub_in21k.get_config("regime=long")
  override.objective.num_submodels = 1
  assert override.to_dict() == base.to_dict()


def test_bad_regime_args_fail_clearly():
  with pytest.raises(ValueError, match="regime='longer' must be 'short'"):
    cosub_in21k.get_config("regime=longer")
  with pytest.raises(ValueError, match="regime=long is a demo setting"):
    cosub_in21k.get_config("dataset=imagenet21k_p,regime=long")
