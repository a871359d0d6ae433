r"""cosub on ImageNet-1k from scratch (Touvron et al., "Co-training 2^L Submodels for Visual
Recognition", CVPR 2023): the DeiT-III ImageNet-1k recipe plus submodel co-training.

Two copies of every (mixup/cutmix-ed) image go through two stochastic-depth submodels of the
same ViT in one forward pass; each learns from the labels and from the other's prediction
(objectives/cosub.py). Stochastic depth is efficient (ESD: each residual branch runs only on
the kept rows; supplement C) with rate tau uniform over depth.

Demo (no arg; the embedded `demo` dataset, 32x32, vit_demo, a few minutes on a 2-core CPU):
  python -m bigpretrain.main --config=configs/cosub_in1k.py --workdir=/tmp/cosub_in1k_demo
  Same recipe without cosub:  ... --config.objective.num_submodels=1
  BCE starts slowly on the demo: top-1 is 4.0% after the 400 steps (seed 0; chance is 1%),
  where the CE recipe (configs/cosub_in21k.py) gets about 23%.

Paper scale (ImageNet-1k prepared as ArrayRecord, e.g. `tfds build imagenet2012
--file_format=array_record --data_dir=/data/tfds`):
  ARG=dataset=tfds:imagenet2012,data_dir=/data/tfds,model=vit_b16
  python -m bigpretrain.main --config=configs/cosub_in1k.py:$ARG,epochs=400 \
    --workdir=/runs/cosub_in1k_vit_b16
Hardware: the paper trains on nodes of 8 V100 GPUs at batch 2048 (supplement Table C: ViT-L,
4 x 8 V100, 2048 images per batch, 8 min 56 s per epoch with masked stochastic depth).
Paper numbers (supplement): ViT-B, 400 epochs on ImageNet-1k + 20 epochs of fine-tuning:
83.8% top-1 (800 epochs: 84.2%), Table B.2; at resolution 112, 400 epochs, 5 seeds:
ViT-S 73.15 +- 0.10 vs 72.63 +- 0.37 without cosub, ViT-B 77.75 vs 77.03 (B.4).

Recipe (supplement A.1 on DeiT-III): LAMB as DeiT-III runs it (`--opt fusedlamb`: weight decay
and trust ratio only on weight matrices, none on biases, norms, LayerScale, position embedding
and class token; global grad norm clipped at 1.0), lr = 1e-3 * sqrt(batch / 2048) (the sqrt
rule, A.1; it follows --config.batch_size overrides), weight decay 0.02, 5 warm-up epochs from
1e-6 then cosine down to 1e-5 (deit main.py's --warmup-lr and --min-lr defaults; per step
here, per epoch there); BCE with binarised targets (label smoothing 0); mixup 0.8 / cutmix
1.0; Random Resized Crop + 3-Augment + flip; repeated augmentation x3 (our pipeline keeps the
3 copies in one global batch, so the batch is 1536 = 3 x 512 instead of the paper's 2048; the
lr follows by the sqrt rule); ViT with LayerScale 1e-4, qkv bias, class token, position
embedding added to the patches before the class token joins (pos_embed_cls=False),
truncated-normal head; tau from Table A.1 ("Imnet1k train" row) by ViT size (ViT-S, M, B, L,
H: vit_s16, vit_m16, vit_b16, vit_l16, vit_h14).

Args: dataset (demo | tfds:NAME), data_dir, model (registry name), epochs (400 or 800),
tau (-1 = Table A.1 for the model size; the demo uses 0.5), submodels (2; 1 = no cosub,
3 = supplement D).
"""
import ml_collections

from bigpretrain import config_lib
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


def deit_schedule_ends(config: ml_collections.ConfigDict, lr_scale: float = 1.0) -> None:
  """Warm-up from WARMUP_LR, floor at MIN_LR: fractions of the peak lr * lr_scale (by reference,
  so lr and batch-size overrides keep the absolute values)."""
  peak = config.optim.get_ref("lr") * lr_scale
  config.optim.schedule.warmup_init_factor = WARMUP_LR / peak
  config.optim.schedule.end_factor = MIN_LR / peak


def cosub_model(name: str, tau: float) -> dict:
  """The DeiT-III ViT with uniform-rate efficient stochastic depth.

  DeiT-III initialises the head truncated-normal(0.02) like every linear layer; a zero head
  would also stall under LAMB, whose updates are relative to the weight norm.
  """
  return dict(name=name, drop_path_rate=tau, drop_path_schedule="uniform",
              stochastic_depth="esd", layerscale_init=1e-4, qkv_bias=True, head="token",
              pos_embed_cls=False, head_zeroinit=False)


def base(arg: ml_collections.ConfigDict, *, tau: float, train_augment: str,
         demo_train_augment: str) -> ml_collections.ConfigDict:
  """What the three cosub recipes share; `arg` needs dataset, data_dir, model, submodels."""
  config = config_lib.base_config()
  demo = arg.dataset == "demo"
  config.model = cosub_model(arg.model or ("vit_demo" if demo else "vit_b16"), tau)
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
    config.data.image_size = 224
    config.data.train_augment = train_augment
    config.data.num_workers = 16
    config.batch_size = BASE_BATCH
    config.compute_dtype = "bfloat16"
    config.log_every_steps = 100
    config.eval_every_steps = 5_000
    config.ckpt_every_steps = 2_500
  return config


def parse(arg, **extra):
  """The recipe args shared by the cosub configs (plus `extra` ones)."""
  return config_lib.parse_arg(arg, dataset="demo", data_dir="", model="", tau=-1.0,
                              submodels=2, **extra)


def resolve_tau(arg, key: str) -> float:
  """arg.tau if given (>= 0), the demo's 0.5, or Table A.1's value for the model size."""
  if arg.tau >= 0:
    return arg.tau
  if arg.dataset == "demo" and not arg.model:
    return DEMO_TAU
  return TABLE_A1[vit_size(arg.model or "vit_b16")][key]


def get_config(arg=None):
  """cosub on ImageNet-1k from scratch; `arg` e.g. 'dataset=tfds:imagenet2012,model=vit_b16'."""
  arg = parse(arg, epochs=400.0)
  config = base(arg, tau=resolve_tau(arg, "tau_in1k"),
                train_augment="inception_crop|three_augment|flip",
                demo_train_augment="simple_random_crop|flip")
  config.objective.kind = "bce"
  config.objective.bce_binarize = True  # DeiT-III: targets > 0 after mixup become 1.
  # The 3 copies of an image share a global batch, so the batch must be a multiple of 3.
  config.data.repeated_augment = 3
  config.mixup = dict(mixup_alpha=0.8, cutmix_alpha=1.0, switch_prob=0.5, label_smoothing=0.0)
  if arg.dataset == "demo":
    config.batch_size = 96
    # LAMB's updates are relative to the weights: a short run needs a large lr.
    config.optim.lr = sqrt_lr(config, DEMO_LAMB_LR)
  else:
    config.batch_size = 1536  # 3 x 512: the multiple of 3 nearest the paper's 2048.
    config.num_epochs = arg.epochs
    config.optim.lr = sqrt_lr(config, 1e-3)
    config.optim.schedule.warmup_frac = 5.0 / arg.epochs
  deit_schedule_ends(config)
  return config
