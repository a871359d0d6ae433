r"""SWAG ViT hashtag pretraining (Singh et al., "Revisiting Weakly Supervised Pre-Training
of Visual Perception Models", CVPR 2022, section 3.2).

Demo (no arg: `hashtags:demo`, the demo's tags canonicalised through WordNet, head/tail
resampled; the 4-block demo ViT on 32x32 images, a few minutes on a 2-core CPU):
  python -m bigpretrain.main --config=configs/swag_vit.py --workdir=/tmp/swag_vit
  python -m bigpretrain.tools.zero_shot --workdir=/tmp/swag_vit --dataset=demo --aggregation=max_split

Paper scale (a hashtag dataset prepared by `python -m input_pipeline.prepare hashtags`),
ViT-H/14 by default:
  ARG=dataset=hashtags:ig,data_dir=/data/tfds,model=vit_h14
  python -m bigpretrain.main --config=configs/swag_vit.py:$ARG --workdir=/runs/swag_vit_h14
Hardware: 128 V100 32GB GPUs, 16 nodes of 8 (section 3.2).
Paper numbers (ViT H/14 / L/16 / B/16): fine-tuned on ImageNet-1k 88.6 (518px) / 88.1
(512px) / 85.3 (384px) top-1 (Table 1); zero-shot on ImageNet-1k 72.3 / 71.6 / 67.7 with
Platt scaling, 62.8 / 62.1 / 58.4 without (Table 3; appendix D: ViTs aggregate with
max_split).

Recipe (section 3.2): AdamW, b1 0.9, b2 0.95, lr 4e-4 at batch 8,192 scaled linearly, weight
decay 0.1; the extra linear layer of width = hidden before the classifier (pre_logits=True).
The paper does not say which ViT params are decayed: ours skips biases, norms, pos_embed and
cls_token (the DeiT / timm / big_vision rule, optim's default).

Args: dataset (hashtags:NAME), data_dir, model (registry name), samples (train samples; -1:
the paper's 10 billion, or the demo's steps).
"""
from configs import swag_common

BASE_LR = 4e-4  # At BASE_BATCH (section 3.2).
BASE_BATCH = 8192
WEIGHT_DECAY = 0.1
# 400 demo steps at batch 128: the paper's rule would give 6e-6, far too little to move.
DEMO_LR = 2e-3


def get_config(arg=None):
  """SWAG ViT config; `arg` e.g. 'dataset=hashtags:ig,data_dir=/data,model=vit_b16'."""
  arg = swag_common.parse(arg)
  config = swag_common.base(arg, model="vit_h14", demo_model="vit_demo",
                            paper_batch=BASE_BATCH, demo_batch=128, demo_steps=400)
  config.model.pre_logits = True
  config.optim.name = "adamw"
  config.optim.b1 = 0.9
  config.optim.b2 = 0.95
  config.optim.lr = swag_common.linear_lr(config, BASE_LR, BASE_BATCH)
  config.optim.weight_decay = WEIGHT_DECAY
  if arg.dataset == "hashtags:demo":
    config.optim.lr = DEMO_LR
  return config
