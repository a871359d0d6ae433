r"""Fine-tuning a cosub ImageNet-21k model on ImageNet-1k (Touvron et al., "Co-training 2^L
Submodels for Visual Recognition", CVPR 2023, supplement A.1), with cosub and LayerDecay.

Demo (no arg; the embedded `demo` dataset, 32x32, vit_demo, from scratch unless given a
checkpoint; a few minutes on a 2-core CPU):
  python -m bigpretrain.main --config=configs/cosub_finetune_in1k.py --workdir=/tmp/cosub_ft_demo
  From the demo pre-training (same 100 demo classes, so the head loads too):
  python -m bigpretrain.main \
    --config=configs/cosub_finetune_in1k.py:init=/tmp/cosub_in21k_demo/checkpoints \
    --workdir=/tmp/cosub_ft_demo2
  docs/recipes.md gives what these 400 steps do to the seed-0 demo pre-training.

Paper scale (from the checkpoint of configs/cosub_in21k.py; ImageNet-1k as ArrayRecord):
  ARG=dataset=tfds:imagenet2012,data_dir=/data/tfds,model=vit_b16
  python -m bigpretrain.main \
    --config=configs/cosub_finetune_in1k.py:$ARG,init=/runs/cosub_in21k_vit_b16/checkpoints \
    --workdir=/runs/cosub_ft_vit_b16
Hardware: nodes of 8 V100 GPUs (supplement Table C); the batch may be lowered for memory, the
lr follows it by the sqrt rule.
Paper numbers (supplement Table B.2), 50 fine-tuning epochs after 90 epochs of 21k
pre-training: ViT-B 86.0% top-1 (86.3% after 270 epochs), ViT-L 87.5%.

Recipe: DeiT-III's 21k -> 1k fine-tuning (facebookresearch/deit README_revenge.md, "finetuning
on ImageNet-1k" commands): LAMB (`--opt fusedlamb`, as in configs/cosub_common.py), weight decay
0.02, 50 epochs, 5 warm-up epochs from 1e-6 then cosine down to 1e-5, batch 2048 (`--batch 64
--node 4 --gpu 8`), softmax CE with label smoothing 0.1, cutmix 1.0 and no mixup (`--mixup 0
--cutmix 1.0 --smoothing 0.1`), Simple Random Crop + 3-Augment (colour jitter 0.3) + flip
(`--src --ThreeAugment --color-jitter 0.3`), no repeated augmentation, drop path by size
(`--drop-path`: ViT-S 0.05, B 0.15, L 0.4, H 0.45; DeiT-III has no ViT-M command, so ViT-M
takes its Table A.1 ImageNet-1k tau, 0.1).
cosub's changes (supplement A.1): lr = 1e-4 * sqrt(batch / 2048) * C_LD (A.2; DeiT-III uses
3e-4) with LayerDecay (LD from Table A.1 by ViT size) and C_LD = 2; cosub on, with CE.
LayerDecay follows the supplement's own rule, the one C_LD = 2 was set for: block l of L gets
lr x LD^(L - l), "all layers except the final block" affected, the head x 1, the embeddings
x LD^L. layer_decay_convention=mae selects BEiT/MAE's LD^(L + 1 - l) (last block x LD).

The 21k checkpoint's head has the 21k classes: model_init keeps a head of another class count
(and arrays matching config.model_init_skip) freshly initialised, so the 1k head starts anew.
At another resolution than the checkpoint's, the model is built at `res` and model_init resizes
the position embedding bicubically with half-pixel centres, as DeiT's fine-tuning does
(`F.interpolate(..., mode='bicubic', align_corners=False)`, cosub's code base); a converted
checkpoint's as its library does (config.model_init_resize='auto').

Args: dataset, data_dir, model, init (checkpoint dir -> config.model_init; required outside the
demo, `none` to train from scratch), epochs (50),
res (image size; -1: 224, 32 on the demo; above 224 adds A.1's 0.05 to tau), tau (-1 =
DeiT-III's fine-tuning drop path; the demo uses 0.5), layer_decay (-1 = Table A.1;
the demo uses 0.75), layer_decay_convention (cosub | mae), submodels (2).
"""
from configs import cosub_common

DEMO_LAYER_DECAY = 0.75
# DeiT-III's --drop-path for 21k -> 1k fine-tuning (README_revenge.md), by ViT size; ViT-M has
# no DeiT-III command and takes cosub Table A.1's ImageNet-1k value.
FINETUNE_TAU = {"s": 0.05, "m": 0.1, "b": 0.15, "l": 0.4, "h": 0.45}
BASE_LR = 1e-4  # A.2, at batch 2048: a tenth of the training lr.


def get_config(arg=None):
  """cosub fine-tuning on 1k; `arg` e.g. 'dataset=tfds:imagenet2012,model=vit_b16,init=DIR'."""
  arg = cosub_common.parse(arg, init="", epochs=50.0, layer_decay=-1.0,
                           layer_decay_convention="cosub")
  if arg.dataset != "demo" and not arg.init:
    raise ValueError(f"dataset={arg.dataset} needs init=DIR, the checkpoint to fine-tune (the "
                     "run of configs/cosub_in21k.py), or init=none to train from scratch.")
  if arg.init == "none":
    arg.init = ""
  if arg.tau >= 0:
    tau = arg.tau
  elif arg.dataset == "demo" and not arg.model:
    tau = cosub_common.DEMO_TAU
  else:
    tau = FINETUNE_TAU[cosub_common.vit_size(arg.model or "vit_b16")]
    if cosub_common.more_regularization(arg):  # A.1: + 0.05 at large resolutions.
      tau = round(tau + cosub_common.MORE_REG_TAU, 4)
  config = cosub_common.base(arg, tau=tau,
                             train_augment="simple_random_crop|three_augment|flip",
                             demo_train_augment="simple_random_crop|flip")
  config.model_init = arg.init
  if arg.res > 0:  # The demo's too: the model is built at it, model_init resizes pos_embed.
    config.data.image_size = arg.res
  config.objective.kind = "ce"
  # Label smoothing 0.1 goes with cutmix: the train step builds the smoothed, mixed targets.
  config.mixup = dict(mixup_alpha=0.0, cutmix_alpha=1.0, switch_prob=0.5, label_smoothing=0.1)
  if arg.layer_decay >= 0:
    config.optim.layer_decay = arg.layer_decay
  elif arg.dataset == "demo" and not arg.model:
    config.optim.layer_decay = DEMO_LAYER_DECAY
  else:
    size = cosub_common.vit_size(arg.model or "vit_b16")
    config.optim.layer_decay = cosub_common.TABLE_A1[size]["layer_decay"]
  config.optim.layer_decay_convention = arg.layer_decay_convention
  config.optim.layer_decay_lr_scale = 2.0  # C_LD (A.1); the optimizer applies it.
  if arg.dataset == "demo":
    # A tenth of the demo's training lr, as A.2 divides the paper's by 10.
    config.optim.lr = cosub_common.sqrt_lr(config, cosub_common.DEMO_LAMB_LR / 10)
  else:
    config.num_epochs = arg.epochs
    config.optim.lr = cosub_common.sqrt_lr(config, BASE_LR)
    config.optim.schedule.warmup_frac = 5.0 / arg.epochs
  cosub_common.deit_schedule_ends(config)
  return config
