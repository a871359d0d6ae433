r"""Fine-tuning a cosub ImageNet-21k model on ImageNet-1k (Touvron et al., "Co-training 2^L
Submodels for Visual Recognition", CVPR 2023, supplement A.1), with cosub and LayerDecay.

Demo (no arg; the embedded `demo` dataset, 32x32, vit_demo, from scratch unless given a
checkpoint; a few minutes on a 2-core CPU):
  python -m bigpretrain.main --config=configs/cosub_finetune_in1k.py --workdir=/tmp/cosub_ft_demo
  From the demo pre-training (same 100 demo classes, so the head loads too):
  python -m bigpretrain.main \
    --config=configs/cosub_finetune_in1k.py:init=/tmp/cosub_in21k_demo/checkpoints \
    --workdir=/tmp/cosub_ft_demo2

Paper scale (from the checkpoint of configs/cosub_in21k.py; ImageNet-1k as ArrayRecord):
  ARG=dataset=tfds:imagenet2012,data_dir=/data/tfds,model=vit_b16
  python -m bigpretrain.main \
    --config=configs/cosub_finetune_in1k.py:$ARG,init=/runs/cosub_in21k_vit_b16/checkpoints \
    --workdir=/runs/cosub_ft_vit_b16
Hardware: nodes of 8 V100 GPUs (supplement Table C); the batch may be lowered for memory, the
lr follows it by the sqrt rule.
Paper numbers (supplement Table B.2), 50 fine-tuning epochs after 90 epochs of 21k
pre-training: ViT-B 86.0% top-1 (86.3% after 270 epochs), ViT-L 87.5%.

Recipe: lr = 1e-4 * sqrt(batch / 2048) * C_LD (A.2) with C_LD = 2 because LayerDecay is on
(block l of L gets lr x LD^(L + 1 - l); patch embedding, class token and position embedding
are layer 0; LD from Table A.1 by ViT size); AdamW (A.1 pairs the sqrt rule with AdamW for
fine-tuning), weight decay 0.02, 5 warm-up epochs then cosine, 50 epochs; softmax CE (A.1:
cross-entropy when fine-tuning from 21k) with mixup 0.8 / cutmix 1.0 and label smoothing 0.1;
Random Resized Crop + 3-Augment + flip. The supplement gives no fine-tuning tau; we use its
"Imnet1k train" row of Table A.1 (the fine-tuning data is ImageNet-1k).

The 21k checkpoint's head has the 21k classes: model_init keeps arrays whose shape differs
(and those matching config.model_init_skip) freshly initialised, so the 1k head starts anew.

Args: dataset, data_dir, model, init (checkpoint dir -> config.model_init), epochs (50),
tau (-1 = Table A.1), layer_decay (-1 = Table A.1; the demo uses 0.75), submodels (2).
"""
from configs import cosub_in1k

DEMO_LAYER_DECAY = 0.75


def get_config(arg=None):
  """cosub fine-tuning on 1k; `arg` e.g. 'dataset=tfds:imagenet2012,model=vit_b16,init=DIR'."""
  arg = cosub_in1k.parse(arg, init="", epochs=50.0, layer_decay=-1.0)
  config = cosub_in1k.base(arg, tau=cosub_in1k.resolve_tau(arg, "tau_in1k"),
                           train_augment="inception_crop|three_augment|flip",
                           demo_train_augment="simple_random_crop|flip")
  config.model_init = arg.init
  config.objective.kind = "ce"
  config.mixup = dict(mixup_alpha=0.8, cutmix_alpha=1.0, switch_prob=0.5, label_smoothing=0.1)
  config.optim.name = "adamw"
  if arg.layer_decay >= 0:
    config.optim.layer_decay = arg.layer_decay
  elif arg.dataset == "demo" and not arg.model:
    config.optim.layer_decay = DEMO_LAYER_DECAY
  else:
    size = cosub_in1k.vit_size(arg.model or "vit_b16")
    config.optim.layer_decay = cosub_in1k.TABLE_A1[size]["layer_decay"]
  config.optim.layer_decay_lr_scale = 2.0  # C_LD (A.1); the optimizer applies it.
  if arg.dataset == "demo":
    config.optim.lr = cosub_in1k.sqrt_lr(config, 4e-3)
  else:
    config.num_epochs = arg.epochs
    config.optim.lr = cosub_in1k.sqrt_lr(config, 1e-4)
    config.optim.schedule.warmup_frac = 5.0 / arg.epochs
  return config
