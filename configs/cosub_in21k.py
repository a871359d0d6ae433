r"""cosub pre-training on ImageNet-21k (Touvron et al., "Co-training 2^L Submodels for Visual
Recognition", CVPR 2023): the DeiT-III ImageNet-21k recipe plus submodel co-training, with
softmax cross-entropy as the loss (supplement A.1). Fine-tune the result on ImageNet-1k with
configs/cosub_finetune_in1k.py.

Demo (no arg; the embedded `demo` dataset, 32x32, vit_demo, a few minutes on a 2-core CPU):
  python -m bigpretrain.main --config=configs/cosub_in21k.py --workdir=/tmp/cosub_in21k_demo
  Same recipe without cosub:  ... --config.objective.num_submodels=1
  At demo scale cosub does not beat the baseline (docs/recipes.md, "cosub on the demo", has
  the figures for seeds 0/1/2): 2.5 epochs is an under-fitting regime, where a regulariser
  such as cosub has little to give.

Demo, long regime (`:regime=long`): what cosub is for. The supplement trains for long
schedules (400-800 epochs on ImageNet-1k, 270 on ImageNet-21k, where A.1 adds 0.05 to tau
because "more regularization is needed"). At demo scale: a seeded class-balanced 10% of the
demo's train split (data.subset_frac=0.1, subset_seed=0: 2,009 images, ~20 per class) seen
for 30 epochs (471 steps at batch 128), tau 0.5 + 0.05 = 0.55. Stochastic depth is part of
the recipe, so the baseline keeps tau 0.55 too; only the number of submodels differs. A cosub
step costs ~1.9x a plain one (seed 2's runs back to back on a shared 2-core CPU: 214 vs 415
images/s, 360 s vs 195 s a run). The command (seeds 0, 1, 2):
  python -m bigpretrain.main --config=configs/cosub_in21k.py:regime=long --config.seed=0 \
    --workdir=/tmp/cosub_long_s0            # + --config.objective.num_submodels=1: no cosub
  cosub does not win here either (docs/recipes.md): the baseline does not over-fit (cutmix,
  smoothing and tau 0.55 already regularise vit_demo), so cosub's extra regularisation costs
  accuracy here rather than helping.

Paper scale (ImageNet-21K-P prepared by `python -m input_pipeline.prepare imagenet21k_p`; the
paper uses the full ImageNet-21k release, which any tfds:NAME ArrayRecord build can stand in
for):
  ARG=dataset=imagenet21k_p,data_dir=/data/tfds,model=vit_b16
  python -m bigpretrain.main --config=configs/cosub_in21k.py:$ARG,epochs=90 \
    --workdir=/runs/cosub_in21k_vit_b16
Hardware: nodes of 8 V100 GPUs at batch 2048 (supplement Table C).
Paper numbers (supplement Table B.2): ViT-B pre-trained 90 epochs on ImageNet-21k with cosub
and fine-tuned 50 epochs on ImageNet-1k: 86.0% top-1 (270 epochs: 86.3%); ViT-L, 90 epochs:
87.5%.
Table B.1, other architectures with the same recipe at 224 (90 epochs of 21k, 50 of 1k
fine-tuning; ImageNet val / v2 top-1; the table gives no tau, so pass `tau=`): ResNet-152
83.1 / 73.1 (`model=resnet152`), RegNet-16GF 84.2 / 74.7 (`model=regnety_16gf`); not in the
model registry, so not runnable here: PiT-B distilled 85.8 / 76.8, ConvNeXt-S 85.2 / 76.0,
ConvNeXt-B 85.8 / 76.9, XCiT-S12 84.2 / 74.9, XCiT-M24 86.5 / 77.9, XCiT-L24 87.2 / 77.8,
Swin-B 86.2 / 77.2, Swin-L 87.1 / 78.1.

Recipe (supplement A.1 on DeiT-III): LAMB as DeiT-III runs it (see configs/cosub_common.py),
lr = 1e-3 * sqrt(batch / 2048), weight decay 0.02, 5 warm-up epochs from 1e-6 then cosine
down to 1e-5; softmax CE with label smoothing 0.1 (applied by the cutmix step);
cutmix 1.0, no mixup; Simple Random Crop + 3-Augment + flip; 90 or 270 epochs; tau from
Table A.1 ("Imnet21k pre-train" row), + 0.05 for 270 epochs or a resolution above 224 (A.1:
"more regularization"; once if both).

Args: dataset (demo | imagenet21k_p | tfds:NAME), data_dir, model, res (image size; -1:
224), epochs (90 or 270),
tau (-1 = Table A.1; the demo uses 0.5), submodels (2; 1 = no cosub), regime (demo only: short =
400 steps over all of train; long = 30 epochs over a 10% per-class subset, tau + 0.05).
"""
from configs import cosub_common

# regime=long: a class-balanced 10% of the demo's train split (data.subset_frac, ~20 images per
# class), 30 epochs over it.
LONG_SUBSET_FRAC = 0.1
LONG_EPOCHS = 30.0


def get_config(arg=None):
  """cosub 21k pre-training; `arg` e.g. 'dataset=imagenet21k_p,data_dir=/data,model=vit_b16'."""
  arg = cosub_common.parse(arg, epochs=90.0, regime="short")
  if arg.regime not in ("short", "long"):
    raise ValueError(f"regime={arg.regime!r} must be 'short' (400 steps over the demo's "
                     "train split) or 'long' (many epochs over a small subset of it).")
  long_demo = arg.regime == "long"
  if long_demo and arg.dataset != "demo":
    raise ValueError(f"regime=long is a demo setting; with dataset={arg.dataset!r} set the "
                     "length with epochs= (270 is the paper's long schedule).")
  # Long schedules get more stochastic depth (A.1: "more regularization").
  tau = cosub_common.resolve_tau(
      arg, "tau_in21k", more_reg=long_demo or (arg.dataset != "demo" and arg.epochs > 90))
  config = cosub_common.base(arg, tau=tau,
                             train_augment="simple_random_crop|three_augment|flip",
                             demo_train_augment="simple_random_crop|flip")
  config.objective.kind = "ce"
  # Label smoothing 0.1 goes with cutmix: the train step builds the smoothed, mixed targets.
  config.mixup = dict(mixup_alpha=0.0, cutmix_alpha=1.0, switch_prob=0.5, label_smoothing=0.1)
  if arg.dataset == "demo":
    config.optim.lr = cosub_common.sqrt_lr(config, cosub_common.DEMO_LAMB_LR)
    if long_demo:
      # Few images seen many times, where a regulariser has something to prevent.
      config.data.subset_frac = LONG_SUBSET_FRAC
      config.data.subset_seed = 0
      config.total_steps = -1
      config.num_epochs = LONG_EPOCHS
  else:
    config.num_epochs = arg.epochs
    config.optim.lr = cosub_common.sqrt_lr(config, 1e-3)
    config.optim.schedule.warmup_frac = 5.0 / arg.epochs
  cosub_common.deit_schedule_ends(config)
  return config
