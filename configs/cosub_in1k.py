r"""cosub on ImageNet-1k from scratch (Touvron et al., "Co-training 2^L Submodels for Visual
Recognition", CVPR 2023): the DeiT-III ImageNet-1k recipe plus submodel co-training.

Two copies of every (mixup/cutmix-ed) image go through two stochastic-depth submodels of the
same ViT in one forward pass; each learns from the labels and from the other's prediction
(objectives/cosub.py). Stochastic depth is efficient (ESD: each residual branch runs only on
the kept rows; supplement C) with rate tau uniform over depth; each device keeps
floor((1 - tau) x its rows), so the dropped rows round up and the effective rate (logged as
train/esd_effective_drop) is at least tau (C.1).

Demo (no arg; the embedded `demo` dataset, 32x32, vit_demo, a few minutes on a 2-core CPU):
  python -m bigpretrain.main --config=configs/cosub_in1k.py --workdir=/tmp/cosub_in1k_demo
  Same recipe without cosub:  ... --config.objective.num_submodels=1
  The fine-tuning stage (DEMO_FINETUNE_STEPS steps at the demo's 32 px):
  python -m bigpretrain.main --config=configs/cosub_in1k.py:stage=finetune,\
init=/tmp/cosub_in1k_demo --workdir=/tmp/cosub_in1k_ft_demo
  BCE starts slowly on the demo: top-1 is 4.0% after the 400 steps (seed 0; chance is 1%),
  where the CE recipe (configs/cosub_in21k.py) gets about 9% (docs/recipes.md).

Paper scale (ImageNet-1k prepared as ArrayRecord, e.g. `tfds build imagenet2012
--file_format=array_record --data_dir=/data/tfds`):
  ARG=dataset=tfds:imagenet2012,data_dir=/data/tfds,model=vit_b16
  python -m bigpretrain.main --config=configs/cosub_in1k.py:$ARG,epochs=400 \
    --workdir=/runs/cosub_in1k_vit_b16
  then the 20-epoch fine-tuning at 224 (`stage=finetune`, below):
  python -m bigpretrain.main --config=configs/cosub_in1k.py:$ARG,stage=finetune,\
init=/runs/cosub_in1k_vit_b16 --workdir=/runs/cosub_in1k_ft_vit_b16
Hardware: the paper trains on nodes of 8 V100 GPUs at batch 2048 (supplement Table C: ViT-L,
4 x 8 V100, 2048 images per batch, 8 min 56 s per epoch with masked stochastic depth).
Paper numbers (supplement): Table B.2, 400 epochs of training then 20 of fine-tuning on
ImageNet-1k ("400^(1k) + 20^(1k)", evaluated at 224): ViT-B 83.8 / 88.6 / 73.5 top-1 on val /
ReaL / v2 (800 epochs: 84.2 / 88.5 / 74.2), ViT-L 85.0 / 89.4 / 75.5 (800: 85.3 / 89.2 /
75.5). B.4's protocol is the training stage alone at resolution 112 (`res=112`), 5 seeds:
ViT-S 73.15 +- 0.10 vs 72.63 +- 0.37 without cosub, ViT-B 77.75 vs 77.03, ViT-L 80.64 vs
79.46, ViT-H 82.29 vs 80.94.

Resolutions (DeiT-III's published ImageNet-1k commands, facebookresearch/deit
README_revenge.md, which cosub follows: `--input-size`): the training stage runs at
TRAIN_RES by ViT size, 224 for ViT-S, 192 for ViT-B and ViT-L, 160 for ViT-H (ViT-M, which
has no DeiT-III command, at 224), and the fine-tuning stage at 224, the resolution Table B.2
evaluates at; model_init resizes the ViT's position embeddings to the new grid.
The fine-tuning stage (`stage=finetune,init=DIR`, "20^(1k)"): the supplement gives no recipe;
DeiT-III's published 20-epoch fine-tuning command (README_revenge.md, "finetuning for ViT-S
at resolution 384x384", here at 224) is `--lr 1e-5 --epochs 20 --weight-decay 0.1 --sched
cosine --smoothing 0.1 --warmup-epochs 5 --opt fusedlamb --warmup-lr 1e-6 --mixup .8
--cutmix 1.0 --unscale-lr --repeated-aug --aa rand-m9-mstd0.5-inc1` at batch 64 x 8 GPUs:
LAMB, lr 1e-5 at batch 512 (sqrt rule for others, A.1), 5 warm-up epochs from 1e-6 then
cosine to deit's --min-lr 1e-5, softmax CE (no `--bce-loss`; A.1: cross-entropy when
fine-tuning) with label smoothing 0.1, mixup 0.8 / cutmix 1.0, repeated augmentation x3,
RandAugment (timm's rand-m9-inc1, our randaugment(2, 9, 0.5, 1): the increasing ops, without
mstd0.5's magnitude noise; deit drops --color-jitter when --aa is set) after random-resized
crop and flip. cosub's changes
(A.1): weight decay 0.02 ("independent of whether we pre-train ... or fine-tune"), cosub on,
tau from Table A.1's ImageNet-1k row (DeiT-III gives ViT-S 0, which disables cosub; A.1 uses
0.05 for such cases, Table A.1's ViT-S value). No LayerDecay: A.1 states it for the 21k ->
1k fine-tuning, DeiT-III's command has none.

Recipe (supplement A.1 on DeiT-III): LAMB as DeiT-III runs it (`--opt fusedlamb`: weight decay
and trust ratio only on weight matrices, none on biases, norms, LayerScale, position embedding
and class token; global grad norm clipped at 1.0), lr = 1e-3 * sqrt(batch / 2048) (the sqrt
rule, A.1; it follows --config.batch_size overrides), weight decay 0.02, 5 warm-up epochs from
1e-6 then cosine down to 1e-5 (deit main.py's --warmup-lr and --min-lr defaults; per step
here, per epoch there); BCE with binarised targets (label smoothing 0); mixup 0.8 / cutmix
1.0; Random Resized Crop (bicubic, as DeiT-III's) + 3-Augment + flip; repeated augmentation
x3 (our pipeline keeps the 3 copies in one global batch, so the batch is 1536 = 3 x 512
instead of the paper's 2048; the lr follows by the sqrt rule; each host's copies are mixed as
blocks of their own, with their own lam and partners, as DeiT-III's GPUs mix theirs); ViT
with LayerScale 1e-4, qkv bias, class token, position embedding added to the patches before
the class token joins (pos_embed_cls=False), truncated-normal head; tau from Table A.1
("Imnet1k train" row) by ViT size (ViT-S, M, B, L, H: vit_s16, vit_m16, vit_b16, vit_l16,
vit_h14).

Args: dataset (demo | tfds:NAME), data_dir, model (registry name), epochs (400 or 800; the
fine-tuning stage's: 20), res (image size; -1: TRAIN_RES by size, 224 when fine-tuning), tau
(-1 = Table A.1 for the model size, + 0.05 above 224 px, A.1's "large resolutions"; the demo
uses 0.5), submodels (2; 1 = no cosub, 3 = supplement D), stage (train | finetune), init
(the training stage's run or checkpoint dir, for stage=finetune).
"""
from configs import cosub_common as common

# DeiT-III's ImageNet-1k training --input-size by ViT size (README_revenge.md; no ViT-M).
TRAIN_RES = {"s": 224, "m": 224, "b": 192, "l": 192, "h": 160}
FINETUNE_EPOCHS = 20.0  # Table B.2's "20^(1k)".
# DeiT-III's fine-tuning command: --lr 1e-5 at batch 64 x 8 GPUs, --unscale-lr.
FINETUNE_LR, FINETUNE_BATCH = 1e-5, 512
FINETUNE_AUGMENT = "inception_crop_bicubic|flip|randaugment(2, 9, 0.5, 1)"  # --aa rand-m9-...-inc1.
DEMO_FINETUNE_STEPS = 100


def get_config(arg=None):
  """cosub on ImageNet-1k from scratch; `arg` e.g. 'dataset=tfds:imagenet2012,model=vit_b16'."""
  arg = common.parse(arg, epochs=-1.0, stage="train", init="")
  if arg.stage not in ("train", "finetune"):
    raise ValueError(f"config arg stage={arg.stage!r}: expected train or finetune.")
  if arg.stage == "finetune":
    return finetune_config(arg)
  if arg.init:
    raise ValueError("config arg init= is for stage=finetune; the training stage starts "
                     "from scratch.")
  if arg.epochs < 0:
    arg.epochs = 400.0
  if arg.res < 0 and arg.dataset != "demo":
    arg.res = train_res(arg.model or "vit_b16")
  config = common.base(arg, tau=common.resolve_tau(arg, "tau_in1k"),
                       train_augment="inception_crop_bicubic|three_augment|flip",
                       demo_train_augment="simple_random_crop|flip")
  config.objective.kind = "bce"
  config.objective.bce_binarize = True  # DeiT-III: targets > 0 after mixup become 1.
  # The 3 copies of an image share a global batch, so the batch must be a multiple of 3.
  config.data.repeated_augment = 3
  config.mixup = dict(mixup_alpha=0.8, cutmix_alpha=1.0, switch_prob=0.5, label_smoothing=0.0)
  if arg.dataset == "demo":
    config.batch_size = 96
    # LAMB's updates are relative to the weights: a short run needs a large lr.
    config.optim.lr = common.sqrt_lr(config, common.DEMO_LAMB_LR)
  else:
    config.batch_size = 1536  # 3 x 512: a multiple of 3 that splits over up to 512 devices.
    config.num_epochs = arg.epochs
    config.optim.lr = common.sqrt_lr(config, 1e-3)
    config.optim.schedule.warmup_frac = 5.0 / arg.epochs
  common.deit_schedule_ends(config)
  return config


def train_res(model: str) -> int:
  """The training stage's resolution: TRAIN_RES for a ViT of Table A.1, else 224 (Table
  B.1's other architectures are trained "at resolution 224")."""
  size = model[len("vit_"):].rstrip("0123456789") if model.startswith("vit_") else ""
  return TRAIN_RES.get(size, common.PAPER_RES)


def finetune_config(arg):
  """The 20-epoch ImageNet-1k fine-tuning at 224 after the training stage (module docstring)."""
  if not arg.init:
    raise ValueError("config arg stage=finetune needs init=DIR, the training stage's run.")
  if arg.epochs < 0:
    arg.epochs = FINETUNE_EPOCHS
  config = common.base(arg, tau=common.resolve_tau(arg, "tau_in1k"),
                       train_augment=FINETUNE_AUGMENT,
                       demo_train_augment="simple_random_crop|flip")
  config.model_init = arg.init
  config.objective.kind = "ce"
  config.data.repeated_augment = 3
  # Label smoothing 0.1 goes with mixup/cutmix: the train step builds the smoothed targets.
  config.mixup = dict(mixup_alpha=0.8, cutmix_alpha=1.0, switch_prob=0.5, label_smoothing=0.1)
  # lr = FINETUNE_LR * sqrt(batch / FINETUNE_BATCH), written at sqrt_lr's batch of 2048.
  base_lr = FINETUNE_LR * (common.BASE_BATCH / FINETUNE_BATCH) ** 0.5
  if arg.dataset == "demo":
    config.batch_size = 96
    config.total_steps = DEMO_FINETUNE_STEPS
    # The paper's fine-tuning / training lr ratio at equal batch, on the demo's training lr.
    config.optim.lr = common.sqrt_lr(config, common.DEMO_LAMB_LR * base_lr / 1e-3)
  else:
    config.batch_size = 1536  # As the training stage: 3 x 512, DeiT-III's batch here.
    config.num_epochs = arg.epochs
    config.optim.lr = common.sqrt_lr(config, base_lr)
    config.optim.schedule.warmup_frac = 5.0 / arg.epochs
  common.deit_schedule_ends(config)
  return config
