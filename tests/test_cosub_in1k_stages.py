"""cosub on ImageNet-1k as Table B.2's "400^(1k) + 20^(1k)" (supplement): the training stage at
DeiT-III's resolutions, then the 20-epoch fine-tuning at 224 (DeiT-III's published commands,
README_revenge.md). Config checks only."""
import numpy as np
import pytest

from bigpretrain import config_lib
from bigpretrain import models
from bigpretrain import optim
from configs import cosub_in1k

PAPER = "dataset=tfds:imagenet2012,model="


@pytest.mark.parametrize("model,res", [("vit_s16", 224), ("vit_b16", 192), ("vit_l16", 192),
                                       ("vit_h14", 160)])
def test_training_stage_runs_at_deit3_input_size(model, res):
  c = cosub_in1k.get_config(PAPER + model)
  assert c.data.image_size == res and c.num_epochs == 400
  assert cosub_in1k.get_config(PAPER + model + ",res=112").data.image_size == 112  # B.4.
  assert cosub_in1k.get_config(PAPER + "resnet152,tau=0.05").data.image_size == 224  # B.1.
  # The model builds at that size (ViT-H/14 at 160: 11 x 11 patches, as DeiT-III's).
  model_def = models.ModelDef.from_config(c.model, 1000, c.compute_dtype, c.data.image_size)
  assert model_def.abstract_module().grid == (res // int(model[5:]),) * 2


def test_finetune_stage_is_deit3s_20_epochs_at_224_with_cosubs_changes():
  c = cosub_in1k.get_config(PAPER + "vit_b16,stage=finetune,init=/runs/in1k")
  config_lib.validate(c)
  assert c.model_init == "/runs/in1k" and "image_size" not in c.model  # Built at 224.
  assert c.data.image_size == 224 and c.num_epochs == 20
  assert c.model.drop_path_rate == 0.2  # Table A.1, "Imnet1k train", ViT-B.
  assert (c.objective.name, c.objective.kind, c.objective.num_submodels) == ("cosub", "ce", 2)
  assert (c.mixup.mixup_alpha, c.mixup.cutmix_alpha, c.mixup.label_smoothing) == (0.8, 1, 0.1)
  assert c.data.repeated_augment == 3  # rand-m9-inc1: the increasing ops.
  assert c.data.train_augment == "inception_crop_bicubic|flip|randaugment(2, 9, 0.5, 1)"
  assert (c.optim.name, c.optim.weight_decay, c.optim.layer_decay) == ("lamb", 0.02, 0.0)
  # --lr 1e-5 at batch 64 x 8 = 512, sqrt rule to our 1536; 5 warm-up epochs from 1e-6,
  # cosine down to deit's --min-lr 1e-5.
  peak = 1e-5 * np.sqrt(1536 / 512)
  assert c.optim.lr == pytest.approx(peak)
  total = 2000
  lr = optim.make_schedule(c.optim.schedule, lr=c.optim.lr, total_steps=total)
  assert float(lr(0)) == pytest.approx(1e-6, rel=1e-4)
  assert float(lr(total // 4)) == pytest.approx(peak, rel=1e-4)  # 5 of 20 epochs.
  assert float(lr(total)) == pytest.approx(1e-5, rel=1e-4)
  # A smaller batch (A.1: "during the fine-tuning stage") puts the sqrt-scaled peak below
  # deit's --min-lr: the floor is then the peak, a constant lr after the warm-up.
  small = cosub_in1k.get_config(PAPER + "vit_b16,stage=finetune,init=/runs/in1k")
  small.batch_size = 256
  config_lib.validate(small)
  peak = 1e-5 * np.sqrt(256 / 512)
  lr = optim.make_schedule(small.optim.schedule, lr=small.optim.lr, total_steps=total)
  assert float(lr(0)) == pytest.approx(1e-6, rel=1e-4)
  assert [float(lr(t)) for t in (total // 4, total // 2, total)] == pytest.approx([peak] * 3)
  with pytest.raises(ValueError, match="stage=finetune needs init="):
    cosub_in1k.get_config(PAPER + "vit_b16,stage=finetune")
  with pytest.raises(ValueError, match="init= is for stage=finetune"):
    cosub_in1k.get_config(PAPER + "vit_b16,init=/runs/in1k")
  with pytest.raises(ValueError, match="stage="):
    cosub_in1k.get_config("stage=pretrain")
