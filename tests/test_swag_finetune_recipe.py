"""configs/swag_finetune.py against SWAG section 4.1, Tables 1, 2, 5 and 8: resolution and
length per model, per-task lr, and the fine-tuned ViT without the tanh representation layer.
Config-only checks (no training); the checkpoint's meta is stubbed."""
import pytest

from bigpretrain import checkpoint
from bigpretrain import config_lib
from configs import swag_finetune


def _meta(model, image_size=224):
  return {"model": dict(model), "data": {"image_size": image_size, "normalize": "imagenet"}}


@pytest.fixture
def init_from(monkeypatch):
  """get_config with init= a checkpoint whose meta holds `model` (pre-trained at 224)."""
  def get(model, arg="", size="large"):
    monkeypatch.setattr(checkpoint, "read_meta", lambda path: _meta(model))
    return swag_finetune.get_config(f"init=/ckpt,size={size},{arg}")
  return get


@pytest.mark.parametrize("model,res", [("regnety_16gf", 384), ("regnety_128gf", 384),
                                       ("vit_b16", 384), ("vit_l16", 512), ("vit_h14", 518)])
def test_finetunes_at_table1_resolution(init_from, model, res):
  config = init_from({"name": model, "pre_logits": model.startswith("vit")},
                     "dataset=tfds:caltech_birds2011")
  assert config.data.image_size == res  # Not the checkpoint's 224.
  assert config.total_steps == 20_000 and config.num_epochs == -1  # Not ImageNet-1k.
  assert config.ema.momentum == 0.0  # The paper's EMA is ImageNet-1k's alone.


def test_table2_runs_and_overrides_keep_pretraining_resolution(init_from):
  regnet = {"name": "regnety_16gf"}
  assert init_from(regnet, "dataset=tfds:imagenet2012,fewshot=0.01").data.image_size == 224
  assert init_from(regnet, "dataset=tfds:imagenet2012,zs_head").data.image_size == 224
  assert init_from(regnet, "dataset=tfds:imagenet2012,res=320").data.image_size == 320
  assert init_from({"name": "resnet50"}, "dataset=tfds:imagenet2012").data.image_size == 224


def test_vits_train_28_epochs_on_imagenet1k(init_from):
  vit = {"name": "vit_b16", "pre_logits": True}
  config = config_lib.validate(init_from(vit, "dataset=tfds:imagenet2012"))
  assert config.num_epochs == 28 and config.total_steps == -1
  assert config_lib.resolve_total_steps(config, 1_281_167) == -(-28 * 1_281_167 // 512)
  assert config.ema.momentum == 0.9999
  regnet = init_from({"name": "regnety_16gf"}, "dataset=tfds:imagenet2012")
  assert regnet.total_steps == 20_000 and regnet.num_epochs == -1  # RegNetY: the step rule.
  few = init_from(vit, "dataset=tfds:imagenet2012,fewshot=0.1", size="medium")
  assert few.total_steps == 10_000 and few.num_epochs == -1


def test_finetuned_vit_drops_the_tanh_layer_unless_the_head_is_zero_shot(init_from):
  vit = {"name": "vit_b16", "pre_logits": True}
  assert init_from(vit, "dataset=tfds:imagenet2012").model.pre_logits is False
  assert init_from(vit, "dataset=tfds:imagenet2012,zs_head").model.pre_logits is True


def test_vit_b16_parameter_count_without_tanh_layer_matches_table5():
  import jax
  from flax import nnx
  from bigpretrain.models import base
  # Table 5: ViT B/16 at 224 with a 1k head, 86.6M; with the tanh layer it would be 87.2M.
  model = nnx.eval_shape(lambda: base.MODELS.get("vit_b16")(num_classes=1000,
                                                             rngs=nnx.Rngs(0)))
  n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert round(n / 1e6, 1) == 86.6


@pytest.mark.parametrize("model,task,lr", [
    ("vit_h14", "cub", 6e-3), ("vit_l16", "cub", 3e-3), ("vit_b16", "places", 3e-3),
    ("regnety_128gf", "places", 6e-3), ("regnety_16gf", "in5k", 1.2e-2),
    ("regnety_32gf", "places", 1.2e-2), ("vit_h14", "in5k", 2.4e-2), ("vit_l16", "inat", 1.2e-2),
    ("vit_b16", "in1k", 6e-3)])
def test_table8_lr_per_model_and_task(init_from, model, task, lr):
  config = init_from({"name": model}, f"dataset=tfds:x,task={task}")
  assert config.optim.lr == pytest.approx(lr)  # At the paper's batch of 512.


def test_task_from_the_dataset_name(init_from):
  assert swag_finetune.task_of("tfds:caltech_birds2011") == "cub"
  assert swag_finetune.task_of("tfds:places365_small/x") == "places"
  assert swag_finetune.task_of("tfds:imagenet2012") == "in1k"
  assert swag_finetune.task_of("demo") == ""
  config = init_from({"name": "regnety_16gf"}, "dataset=tfds:places365_small")
  assert config.optim.lr == pytest.approx(1.2e-2)
  with pytest.raises(ValueError, match="task="):
    swag_finetune.get_config("task=coco")


def test_finetune_sets_its_own_batchnorm_and_resolution(monkeypatch):
  """A semi-supervised checkpoint's 24-image BatchNorm and its pre-training size do not carry
  over: SWAG fine-tunes with synchronised BN (section 4.1), at the run's resolution."""
  model = {"name": "resnet50", "bn_group_size": 24, "image_size": 224}
  monkeypatch.setattr(checkpoint, "read_meta", lambda path: _meta(model))
  config = swag_finetune.get_config("init=/ckpt,size=large,dataset=tfds:imagenet2012")
  assert dict(config.model) == dict(config_lib.model_section(name="resnet50"))
  assert "bn_group_size" not in config.model and "image_size" not in config.model


def _dataset(monkeypatch, class_names):
  """swag_finetune's datasets.get_dataset returning a dataset of these classes."""
  import types
  info = types.SimpleNamespace(class_names=list(class_names), num_classes=len(class_names))
  monkeypatch.setattr(swag_finetune.datasets, "get_dataset",
                      lambda cfg: types.SimpleNamespace(info=info))


def test_task_from_the_class_list_under_any_name(init_from, monkeypatch):
  vit = {"name": "vit_b16"}
  _dataset(monkeypatch, swag_finetune.IN1K_WNIDS.read_text().split())
  in1k = init_from(vit, "dataset=folder:imagenet")  # ImageNet-1k prepared from a folder.
  assert in1k.num_epochs == 28 and in1k.optim.lr == pytest.approx(6e-3)
  # A 365-class dataset that is not named Places365: which column is unknown, so refused...
  _dataset(monkeypatch, [f"scene{i}" for i in range(365)])
  with pytest.raises(ValueError, match="365 classes, as Table 8's places dataset.*task=places"):
    init_from(vit, "dataset=folder:scenes")
  assert init_from(vit, "dataset=folder:scenes,task=places").optim.lr == pytest.approx(3e-3)
  # ... while a dataset that is none of Table 8's gets ImageNet-1k's lr and the step rule.
  _dataset(monkeypatch, [f"pet{i}" for i in range(37)])
  other = init_from(vit, "dataset=folder:pets")
  assert other.total_steps == 20_000 and other.num_epochs == -1
  assert other.optim.lr == pytest.approx(swag_finetune.PAPER_LR)
