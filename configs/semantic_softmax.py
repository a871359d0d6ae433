r"""ImageNet-21K semantic softmax pretraining (Ridnik et al., "ImageNet-21K Pretraining for the
Masses", NeurIPS 2021, section 3.3) — bigpretrain's headline recipe.

One softmax per WordNet hierarchy level; an image activates the levels of its label and its
ancestors; level k is weighted by W_k = O_0 / O_k capped at 20 (the authors' released code;
the paper writes W_k = 1/O_k, which differs only by the constant O_0 and the cap).

Demo (no arg; the embedded `demo` dataset, a few minutes on a 2-core CPU):
  python -m bigpretrain.main --config=configs/semantic_softmax.py --workdir=/tmp/ss_demo

Paper scale (ImageNet-21K-P winter21 prepared by `python -m input_pipeline.prepare
imagenet21k_p`; 8x V100, mixed precision, ~5000 img/s, 80 epochs from an ImageNet-1K init in
~54 h, or 140 epochs from scratch; paper section 3.1 and appendix B):
  python -m bigpretrain.main \
    --config=configs/semantic_softmax.py:dataset=imagenet21k_p,data_dir=/data/tfds,model=vit_b16 \
    --workdir=/runs/ss_vit_b16 [--config.model_init=/ckpts/vit_b16_in1k]
Paper number: ViT-B/16 pretrained this way fine-tunes to 83.9% top-1 on ImageNet-1K
(Table 3; the official 21K weights give 83.3%); TResNet-M semantic softmax pretraining gives
81.4% on ImageNet-1K (Table 2).

Recipe values (appendix B, as the authors' code does it): Adam lr 3e-4 with coupled weight
decay 1e-4 (none on biases and 1-D params), OneCycle schedule with 10% warm-up then cosine,
per-device batch 64 (global 512 on 8 GPUs), squish-resize to 224, RandAugment + Cutout 0.5,
inputs scaled to [0, 1] (no mean/std), label smoothing 0.2, mixed precision (bfloat16 here).

Args: dataset (demo | imagenet21k_p | tfds:NAME), data_dir, model (registry name),
epochs (paper scale: 80 from a 1K init, 140 from scratch).
"""
from bigpretrain import config_lib
from input_pipeline import pipeline


def get_config(arg=None):
  """Semantic softmax config; `arg` e.g. 'dataset=imagenet21k_p,data_dir=/data,model=vit_b16'."""
  arg = config_lib.parse_arg(arg, dataset="demo", data_dir="", model="", epochs=80.0)
  config = config_lib.base_config()
  config.objective = dict(name="semantic_softmax", label_smoothing=0.2, max_weight=20.0)
  config.data = pipeline.data_defaults()
  config.data.name = arg.dataset
  config.data.dir = arg.data_dir
  config.data.normalize = "0_1"  # The recipe feeds [0, 1] pixels, no mean/std.
  config.optim.name = "adam"  # Adam with coupled L2 weight decay.
  config.optim.weight_decay = 1e-4
  config.optim.schedule.name = "onecycle"
  config.optim.schedule.pct_start = 0.1

  if arg.dataset == "demo":
    # Same code path at laptop size: 32x32 synthetic images, a 4-block ViT, a few minutes.
    config.model = dict(name=arg.model or "vit_demo")
    config.data.image_size = 32
    config.data.train_augment = "flip"
    config.batch_size = 128
    config.total_steps = 600
    config.optim.lr = 2e-3  # Higher than the paper's 3e-4: 600 steps instead of ~1.7M.
    config.log_every_steps = 25
    config.eval_every_steps = 200
    config.ckpt_every_steps = 200
  else:
    config.model = dict(name=arg.model or "vit_b16")
    config.data.image_size = 224
    # The authors' order: squish-resize, Cutout (half-size box, random colour), RandAugment.
    config.data.train_augment = "squish|cutout|randaugment(2, 9)"
    config.data.num_workers = 8
    config.batch_size = 512  # 64 per device on 8 devices.
    config.num_epochs = arg.epochs
    config.optim.lr = 3e-4
    config.compute_dtype = "bfloat16"
    config.log_every_steps = 100
    config.eval_every_steps = 10_000
    config.ckpt_every_steps = 5_000
  return config
