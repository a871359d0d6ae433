"""Pieces the cosub configs share (cosub_in1k.py, cosub_in21k.py, cosub_finetune_in1k.py): the
supplement's Table A.1, the sqrt lr rule, deit's schedule ends and the base DeiT-III config."""
import ml_collections

from bigpretrain import config_lib
from configs import common_fewshot
from input_pipeline import pipeline

# Supplement Table A.1, by ViT size: tau for ImageNet-1k training, tau for ImageNet-21k
# pre-training, LayerDecay for fine-tuning.
TABLE_A1 = {
    "s": dict(tau_in1k=0.05, tau_in21k=0.05, layer_decay=0.7),
    "m": dict(tau_in1k=0.1, tau_in21k=0.05, layer_decay=0.75),
    "b": dict(tau_in1k=0.2, tau_in21k=0.1, layer_decay=0.75),
    "l": dict(tau_in1k=0.45, tau_in21k=0.3, layer_decay=0.8),
    "h": dict(tau_in1k=0.6, tau_in21k=0.5, layer_decay=0.85),
}
DEMO_TAU = 0.5
PAPER_RES = 224
# A.1: tau "+0.05 when more regularization is needed, i.e., when pre-training during 270 epochs
# on Imagenet21k or for large resolutions" (above 224: B.2 / Figure B.1 go to 336 and 448).
# Added once when either holds (the text does not say the two stack).
MORE_REG_TAU = 0.05
DEMO_LAMB_LR = 8e-2  # At batch 2048 by the sqrt rule: 2e-2 at the demo's batch of 128.
BASE_BATCH = 2048
# deit main.py defaults that DeiT-III's commands keep (README_revenge.md): the cosine schedule
# warms up from --warmup-lr and ends at --min-lr, both absolute learning rates.
WARMUP_LR = 1e-6
MIN_LR = 1e-5


def vit_size(model: str) -> str:
  """'vit_b16' -> 'b': the Table A.1 column of a registry ViT name."""
  size = model[len("vit_"):].rstrip("0123456789") if model.startswith("vit_") else ""
  if size not in TABLE_A1:
    raise ValueError(f"model={model!r} has no Table A.1 defaults (ViT sizes "
                     f"{sorted(TABLE_A1)}); pass tau= (and layer_decay= when fine-tuning).")
  return size


def sqrt_lr(config: ml_collections.ConfigDict, base_lr: float):
  """lr = base_lr * sqrt(batch_size / 2048) (A.1), tied to config.batch_size by reference."""
  batch = config.get_ref("batch_size")
  return base_lr * (batch.to_float() / float(BASE_BATCH)) ** 0.5


def deit_schedule_ends(config: ml_collections.ConfigDict) -> None:
  """Warm-up from WARMUP_LR, floor at MIN_LR: absolute lrs, as DeiT-III's --warmup-lr and
  --min-lr (held at the peak when a small batch's sqrt-scaled peak is below them)."""
  config.optim.schedule.warmup_init_lr = WARMUP_LR
  config.optim.schedule.end_lr = MIN_LR


def cosub_model(name: str, tau: float) -> dict:
  """The DeiT-III ViT with uniform-rate efficient stochastic depth; any other model (a
  ResNet or RegNet, supplement Table B.1) with uniform-rate masked stochastic depth.

  DeiT-III initialises the head truncated-normal(0.02) like every linear layer; a zero head
  would also stall under LAMB, whose updates are relative to the weight norm.
  """
  if not name.startswith("vit"):
    return dict(name=name, drop_path_rate=tau, drop_path_schedule="uniform")
  return dict(name=name, drop_path_rate=tau, drop_path_schedule="uniform",
              stochastic_depth="esd", layerscale_init=1e-4, qkv_bias=True, head="token",
              pos_embed_cls=False, head_zeroinit=False)


def base(arg: ml_collections.ConfigDict, *, tau: float, train_augment: str,
         demo_train_augment: str) -> ml_collections.ConfigDict:
  """What the three cosub recipes share; `arg` needs dataset, data_dir, model, submodels."""
  config = config_lib.base_config()
  demo = arg.dataset == "demo"
  config.model = config_lib.model_section(
      **cosub_model(arg.model or ("vit_demo" if demo else "vit_b16"), tau))
  config.objective = dict(name="cosub", kind="bce", num_submodels=arg.submodels,
                          label_weight=0.5, label_smoothing=0.0, bce_binarize=False)
  config.data = pipeline.data_defaults()
  config.data.name = arg.dataset
  config.data.dir = arg.data_dir
  config.data.normalize = "imagenet"
  config.data.eval_resize = "center_crop"
  config.optim.name = "lamb"
  config.optim.weight_decay = 0.02
  config.optim.grad_clip_norm = 1.0  # apex FusedLAMB's and timm Lamb's max_grad_norm.
  config.optim.schedule.name = "cosine"
  if demo:
    # Same code path at laptop size. 3-Augment is left out: the demo's classes are told apart
    # by colour, which its grayscale and solarize would erase.
    config.data.image_size = 32
    config.data.train_augment = demo_train_augment
    config.batch_size = 128
    config.total_steps = 400
    config.optim.schedule.warmup_frac = 0.05
    config.log_every_steps = 25
    config.eval_every_steps = 200
    config.ckpt_every_steps = 200
  else:
    config.data.image_size = arg.res if arg.res > 0 else PAPER_RES
    config.data.train_augment = train_augment
    config.data.num_workers = 16
    config.batch_size = BASE_BATCH
    config.compute_dtype = "bfloat16"
    config.log_every_steps = 100
    config.eval_every_steps = 5_000
    config.ckpt_every_steps = 2_500
  return common_fewshot.add(config, demo)


def parse(arg, **extra):
  """The recipe args shared by the cosub configs (plus `extra` ones)."""
  return config_lib.parse_arg(arg, dataset="demo", data_dir="", model="", tau=-1.0,
                              submodels=2, res=-1, **extra)


def more_regularization(arg) -> bool:
  """Whether A.1's tau + 0.05 applies for the resolution: above 224 at paper scale."""
  return arg.dataset != "demo" and arg.res > PAPER_RES


def resolve_tau(arg, key: str, more_reg: bool = False) -> float:
  """arg.tau if given (>= 0), the demo's 0.5, or Table A.1's value for the model size, plus
  MORE_REG_TAU when `more_reg` or a large resolution asks for it (A.1)."""
  if arg.tau >= 0:
    return arg.tau
  if arg.dataset == "demo" and not arg.model:
    tau = DEMO_TAU
  else:
    tau = TABLE_A1[vit_size(arg.model or "vit_b16")][key]
  if more_reg or more_regularization(arg):
    tau += MORE_REG_TAU
  return round(tau, 4)
