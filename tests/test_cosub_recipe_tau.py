"""cosub supplement A.1: tau + 0.05 "for large resolutions" (and for 270 epochs of 21k
pre-training, once if both), in the three cosub configs. Config checks only."""
import pytest

from configs import cosub_finetune_in1k
from configs import cosub_in1k
from configs import cosub_in21k

PAPER = "dataset=tfds:imagenet2012,model=vit_b16"


def test_large_resolution_adds_005_to_tau():
  assert cosub_in1k.get_config(PAPER).model.drop_path_rate == 0.2  # Table A.1, ViT-B.
  at_224 = cosub_in1k.get_config(PAPER + ",res=224")
  assert at_224.model.drop_path_rate == 0.2 and at_224.data.image_size == 224
  at_448 = cosub_in1k.get_config(PAPER + ",res=448")
  assert at_448.model.drop_path_rate == pytest.approx(0.25) and at_448.data.image_size == 448
  assert cosub_in1k.get_config(PAPER + ",res=112").model.drop_path_rate == 0.2  # B.4's size.
  assert cosub_in1k.get_config(PAPER + ",res=448,tau=0.3").model.drop_path_rate == 0.3
  ft = cosub_finetune_in1k.get_config(PAPER + ",res=384,init=/ckpt")
  assert ft.model.drop_path_rate == pytest.approx(0.15 + 0.05)  # DeiT-III's ViT-B 0.15.


def test_21k_long_schedule_and_large_resolution_add_005_once():
  arg = "dataset=imagenet21k_p,model=vit_b16"
  assert cosub_in21k.get_config(arg).model.drop_path_rate == 0.1
  assert cosub_in21k.get_config(arg + ",res=336").model.drop_path_rate == pytest.approx(0.15)
  assert cosub_in21k.get_config(arg + ",epochs=270").model.drop_path_rate == pytest.approx(0.15)
  both = cosub_in21k.get_config(arg + ",epochs=270,res=336")
  assert both.model.drop_path_rate == pytest.approx(0.15)
