r"""ImageNet-21K semantic softmax pretraining (Ridnik et al., "ImageNet-21K Pretraining for the
Masses", NeurIPS 2021, section 3.3) — bigpretrain's headline recipe.

One softmax per WordNet hierarchy level; an image activates the levels of its label and its
ancestors; level k is weighted by W_k = O_0 / O_k capped at 20 (objective.max_weight, the authors'
released code); `--config.objective.max_weight=0` gives the paper's uncapped equation 2,
W_k = 1/O_k up to the constant factor O_0.

Demo (no arg; the embedded `demo` dataset, a few minutes on a 2-core CPU):
  python -m bigpretrain.main --config=configs/semantic_softmax.py --workdir=/tmp/ss_demo

Paper scale (ImageNet-21K-P winter21 prepared by `python -m input_pipeline.prepare
imagenet21k_p`), ViT-B/16 by default:
  ARG=dataset=imagenet21k_p,data_dir=/data/tfds,model=vit_b16
  python -m bigpretrain.main --config=configs/semantic_softmax.py:$ARG --workdir=/runs/ss_vit_b16
runs 140 epochs from scratch; with an ImageNet-1K initialisation, `...:$ARG,init=/ckpts/in1k`,
it runs 80 (section 3.1: 80 epochs from a 1K init, or "similar accuracies" from random init
in 140). Pass the init as `init=`, not --config.model_init, so that the length follows it.
Hardware: 8x V100 with mixed precision (section 3.1; its 40 min per epoch, ~5000 img/s, is
for TResNet-M and ResNet50, not ViT-B).
Paper number for ViT-B/16: pretrained this way it fine-tunes to 83.9% top-1 on ImageNet-1K,
vs 83.3% from the official ImageNet-21K weights (Table 3).

The paper's own backbone is TResNet-M (`model=tresnet_m`; TResNet-L is `model=tresnet_l`),
fed [0, 1] pixels as this recipe does:
  ARG=dataset=imagenet21k_p,data_dir=/data/tfds,model=tresnet_m
  python -m bigpretrain.main --config=configs/semantic_softmax.py:$ARG --workdir=/runs/ss_tresnet_m
Paper numbers for TResNet-M, downstream: after this recipe (Table 2's semantic softmax column,
read as TResNet-M as configs/semantic_kd.py explains) ImageNet-1K 81.4, iNaturalist 72.0,
CIFAR-100 90.4, Food-251 75.8 (top-1 %), MS-COCO 81.3, Pascal-VOC 89.7 (mAP %), Kinetics-200
83.0 (top-1 %); after the whole scheme, semantic KD added (Table 4's ImageNet-21K-P column:
configs/semantic_kd.py), 72.7, 91.7, 76.1, 82.2, 89.8, 84.3 on the last six; after ImageNet-1K
pretraining (Table 4) 70.1, 89.5, 75.1, 79.5, 85.8, 80.5. On 8x V100 it trains at ~5000 img/s,
40 min per epoch (section 3.1).
TResNet needs image sides divisible by 4 (SpaceToDepth stem; 1/32 of the side at the end).
A quick check on the demo data: `:model=tresnet_m --config.total_steps=2
--config.batch_size=16 --config.data.image_size=64 --config.data.train_augment='squish|flip'`.

Recipe (appendix B, as the authors' code does it: Alibaba-MIIL/ImageNet21K
train_semantic_softmax.py and src_files/): Adam lr 3e-4 with coupled weight decay 1e-4 (none
on biases and 1-D params), OneCycle with 10% warm-up then cosine, starting at lr / 20
(their OneCycleLR div_factor=20) and ending at lr / (20 * 1e4) (torch's final_div_factor),
per-device batch 64 (global 512 on 8 GPUs), squish-resize to 224, Cutout on every image
(CutoutPIL, factor 0.5, random colour), RandAugment, inputs scaled to [0, 1] (no mean/std),
label smoothing 0.2, mixed precision (bfloat16 here).
RandAugment differs: theirs (the `randaugment` 1.0.2 package's RandAugment()) draws each of
its 2 ops' magnitude from 1..9 and its op list has Cutout, not SolarizeAdd; ours is timm's
rand-m9-n2 (magnitude 9; both apply each op with probability 0.5).

Args: dataset (demo | demo_plain | imagenet21k_p | tfds:NAME; demo_plain is the demo's
earlier look, input_pipeline/sources/demo.py), data_dir, model (registry name),
init (checkpoint -> config.model_init), epochs (paper scale, -1: 80 with init, else 140).
"""
from bigpretrain import config_lib
from bigpretrain.semantic import tree as tree_lib
from configs import common_fewshot
from input_pipeline.sources import demo
from input_pipeline import pipeline

EPOCHS_FROM_INIT = 80.0  # Section 3.1, from an ImageNet-1K initialisation.
EPOCHS_FROM_SCRATCH = 140.0  # Section 3.1, random initialisation.
# The demo's length for this config and the ones built on it (single-/multi-label, KD): at
# 600 steps semantic softmax and single-label both reach ~0.98+ semantic top-1 on the demo,
# too close to the ceiling to tell them apart (docs/results.md), so every side runs 200.
DEMO_STEPS = 200


def parse(arg, **extra):
  """The args shared by the ImageNet-21K configs (plus `extra` ones)."""
  return config_lib.parse_arg(arg, dataset="demo", data_dir="", model="", init="",
                              epochs=-1.0, **extra)


def base_arg(arg) -> str:
  """`arg`'s shared keys, as the arg string of this config."""
  return ",".join(f"{k}={arg[k]}" for k in ("dataset", "data_dir", "model", "init", "epochs"))


def get_config(arg=None):
  """Semantic softmax config; `arg` e.g. 'dataset=imagenet21k_p,data_dir=/data,model=vit_b16'."""
  arg = parse(arg)
  config = config_lib.base_config()
  config.objective = dict(name="semantic_softmax", label_smoothing=0.2,
                          max_weight=tree_lib.MAX_LEVEL_WEIGHT)
  config.data = pipeline.data_defaults()
  config.data.name = arg.dataset
  config.data.dir = arg.data_dir
  config.data.normalize = "0_1"  # The recipe feeds [0, 1] pixels, no mean/std.
  config.model_init = arg.init
  config.optim.name = "adam"  # Adam with coupled L2 weight decay.
  config.optim.weight_decay = 1e-4
  config.optim.schedule.name = "onecycle"
  config.optim.schedule.pct_start = 0.1

  if demo.is_demo_name(arg.dataset):
    # Same code path at laptop size: 32x32 synthetic images, a small convnet as the paper's
    # TResNet-M is one (vit_demo learns the demo's shapes far more slowly), a few minutes.
    config.model = config_lib.model_section(name=arg.model or "regnety_demo")
    config.data.image_size = 32
    config.data.train_augment = "flip"
    config.batch_size = 128
    config.total_steps = DEMO_STEPS
    config.optim.lr = 2e-3  # Higher than the paper's 3e-4: a few hundred steps, not ~1.7M.
    config.log_every_steps = 25
    config.eval_every_steps = DEMO_STEPS
    config.ckpt_every_steps = DEMO_STEPS
  else:
    config.model = config_lib.model_section(name=arg.model or "vit_b16")
    config.data.image_size = 224
    # The authors' order: squish-resize, Cutout (every image), RandAugment.
    config.data.train_augment = "squish|cutout|randaugment(2, 9)"
    config.data.num_workers = 8
    config.batch_size = 512  # 64 per device on 8 devices.
    if arg.epochs > 0:
      config.num_epochs = arg.epochs
    else:
      config.num_epochs = EPOCHS_FROM_INIT if arg.init else EPOCHS_FROM_SCRATCH
    config.optim.lr = 3e-4
    config.optim.schedule.div_factor = 20.0  # Their OneCycleLR(div_factor=20).
    config.compute_dtype = "bfloat16"
    config.log_every_steps = 100
    config.eval_every_steps = 10_000
    config.ckpt_every_steps = 5_000
  return common_fewshot.add(config, demo=demo.is_demo_name(arg.dataset), dataset=arg.dataset)
