"""The ImageNet-21K recipe configs against the paper and the authors' code."""
import pytest

from bigpretrain import config_lib
from bigpretrain import optim
from configs import semantic_kd
from configs import semantic_softmax
from configs import single_label

PAPER = "dataset=imagenet21k_p,data_dir=/data"


@pytest.mark.parametrize("module", [semantic_softmax, single_label, semantic_kd])
def test_run_length_is_140_epochs_from_scratch_or_80_from_an_init(module):
  extra = ",teacher=/t" if module is semantic_kd else ""
  scratch = module.get_config(PAPER + extra)
  assert scratch.num_epochs == 140 and scratch.model_init == ""
  init = module.get_config(PAPER + extra + ",init=/ckpts/in1k")
  assert init.num_epochs == 80 and init.model_init == "/ckpts/in1k"
  assert module.get_config(PAPER + extra + ",epochs=90").num_epochs == 90
  assert scratch.model.name == "vit_b16"
  config_lib.validate(init)


def test_paper_scale_schedule_and_augmentation_as_the_authors_code():
  config = semantic_softmax.get_config(PAPER)
  assert config.data.train_augment == "squish|cutout|randaugment(2, 9)"
  # OneCycleLR(max_lr=3e-4, pct_start=0.1, div_factor=20), torch's final_div_factor 1e4.
  _, schedule = optim.make_optimizer(config.optim, total_steps=1000)
  assert float(schedule(0)) == pytest.approx(3e-4 / 20, rel=1e-5)
  assert float(schedule(100)) == pytest.approx(3e-4, rel=1e-5)
  assert float(schedule(1000)) == pytest.approx(3e-4 / 20 / 1e4, rel=1e-3)
  assert (config.optim.name, config.optim.weight_decay, config.batch_size) == ("adam", 1e-4, 512)


def test_demo_schedule_is_unchanged():
  config = semantic_softmax.get_config()
  assert config.optim.schedule.div_factor == 25.0 and config.total_steps == 200
  assert config.data.train_augment == "flip" and config.model_init == ""
  assert config.model.name == "regnety_demo"
