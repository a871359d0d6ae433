r"""SWAG RegNetY hashtag pretraining (Singh et al., "Revisiting Weakly Supervised
Pre-Training of Visual Perception Models", CVPR 2022, section 3.2).

Demo (no arg: `hashtags:demo`, the demo's tags canonicalised through WordNet, head/tail
resampled; the 6-block regnety_demo on 32x32 images, a few minutes on a 2-core CPU):
  python -m bigpretrain.main --config=configs/swag_regnety.py --workdir=/tmp/swag_regnety
  python -m bigpretrain.tools.zero_shot --workdir=/tmp/swag_regnety --dataset=demo

Paper scale (a hashtag dataset prepared by `python -m input_pipeline.prepare hashtags`),
RegNetY-128GF by default:
  ARG=dataset=hashtags:ig,data_dir=/data/tfds,model=regnety_128gf
  python -m bigpretrain.main --config=configs/swag_regnety.py:$ARG --workdir=/runs/swag_128gf
Hardware: 128 V100 32GB GPUs, 16 nodes of 8 (section 3.2), 10 billion samples (2 resampled
epochs of IG-3.6B) for the 128GF model.
Paper numbers (RegNetY 128GF / 32GF / 16GF): fine-tuned at 384 on ImageNet-1k 88.2 / 86.8 /
86.0 top-1 (Table 1); zero-shot on ImageNet-1k 75.3 / 73.6 / 72.5 with Platt scaling, 65.1 /
62.2 / 60.7 without (Table 3).

Recipe (section 3.2): SGD with Nesterov momentum 0.9, lr 0.1 per 256 images scaled linearly,
half-cosine to 0, weight decay 1e-5 "disabled in batch-normalization layers": every other
parameter is decayed, biases included (wd_1d=True with the BatchNorm paths excluded), as
ClassyVision, which SWAG trained with, does with bn_weight_decay=False. BatchNorm statistics
are those of the global batch (synchronised over the data axis: see models/regnet.py).
The batch is 8,192 (64 per GPU): the paper states only that batches above 8,192 degraded.
The last BatchNorm scale of each block starts at one, as SWAG's released models do
(zero_init_residual=False).

Args: dataset (hashtags:NAME), data_dir, model (registry name), samples (train samples; -1:
the paper's 10 billion, or the demo's steps).
"""
from configs import swag_common

BASE_LR = 0.1  # Per BASE_BATCH images (section 3.2).
BASE_BATCH = 256
PAPER_BATCH = 8192
WEIGHT_DECAY = 1e-5
# BatchNorm params of the RegNet/ResNet modules: stem_bn/, bn_a/.., proj_bn/ (scale, bias).
BN_PARAMS = r"(?:^|/|_)bn(?:/|_)"


def get_config(arg=None):
  """SWAG RegNetY config; `arg` e.g. 'dataset=hashtags:ig,data_dir=/data,model=regnety_16gf'."""
  arg = swag_common.parse(arg)
  config = swag_common.base(arg, model="regnety_128gf", demo_model="regnety_demo",
                            paper_batch=PAPER_BATCH, demo_batch=64, demo_steps=300)
  config.model.zero_init_residual = False
  config.optim.name = "sgd"
  config.optim.momentum = 0.9
  config.optim.nesterov = True
  config.optim.lr = swag_common.linear_lr(config, BASE_LR, BASE_BATCH)
  config.optim.weight_decay = WEIGHT_DECAY
  config.optim.wd_1d = True
  config.optim.wd_exclude = (BN_PARAMS,)
  return config
