"""What the SWAG pretraining configs share (swag_regnety.py, swag_vit.py): Singh et al.,
"Revisiting Weakly Supervised Pre-Training of Visual Perception Models" (CVPR 2022),
section 3.2.

Both recipes (section 3.2, "Optimization" and what follows):
- lr scaled linearly with the batch (Goyal et al. [28]), warmed up over the first 5% of the
  updates linearly from lr / 10, then a half-cosine to 0;
- mixed precision (bfloat16 here) at paper scale; random-resized crop to 224 and a random
  horizontal flip; no EMA, mixup, label smoothing, AutoAugment or stochastic depth (tried,
  "did not find those approaches to lead to performance improvements");
- eval (and zero-shot, bigpretrain/swag/zero_shot.py) at the pre-training resolution, the shorter
  side resized to it and a centre crop (sections 4.1 and 4.4), not the usual 87.5% crop;
- objective soft_target (1/K on each of an image's K canonical hashtags, section 3.2) on a
  hashtag dataset read through the head/tail resampling sampler (appendix A: head share
  alpha = 0.7, config.data.resample_alpha; Table 4 ablates 0.5 and 0.3).

Duration: the largest model saw 10 billion samples, 2 resampled epochs of IG-3.6B, on 128
V100 32GB GPUs over 16 nodes (section 3.2); `samples=` sets another count.
"""
import ml_collections

from bigpretrain import config_lib
from configs import common_fewshot
from input_pipeline import pipeline

PAPER_SAMPLES = 10_000_000_000  # Section 3.2: "2 epochs of IG-3.6B (10 billion samples)".
WARMUP_FRAC = 0.05  # "the first 5% of training updates".
WARMUP_INIT_FACTOR = 0.1  # "from 1/10-th of the initial value".
TRAIN_AUGMENT = "inception_crop|flip"  # "random-resize crop followed by a random ... flip".
DEMO_IMAGE_SIZE = 32  # The demo's stored images are 32x32.
RESAMPLE_ALPHA = 0.7  # Appendix A: "we chose alpha = 0.7" (the head share).


def parse(arg):
  """The args of the SWAG pretraining configs."""
  return config_lib.parse_arg(arg, dataset="hashtags:demo", data_dir="", model="",
                              samples=-1)


def linear_lr(config: ml_collections.ConfigDict, base_lr: float, base_batch: int):
  """lr = base_lr * batch_size / base_batch, tied to config.batch_size by reference (so a
  --config.batch_size override rescales it)."""
  return base_lr * config.get_ref("batch_size").to_float() / float(base_batch)


def base(arg: ml_collections.ConfigDict, *, model: str, demo_model: str, paper_batch: int,
         demo_batch: int, demo_steps: int) -> ml_collections.ConfigDict:
  """The shared SWAG pretraining config; the recipes set the model's options and optimiser."""
  config = config_lib.base_config()
  demo = arg.dataset == "hashtags:demo"
  config.model = config_lib.model_section(name=arg.model or (demo_model if demo else model))
  config.objective = dict(name="soft_target")
  config.data = pipeline.data_defaults()
  config.data.name = arg.dataset  # Train is read through the dataset's resampling sampler.
  config.data.resample_alpha = RESAMPLE_ALPHA
  config.data.dir = arg.data_dir
  config.data.normalize = "imagenet"  # ClassyVision's ImageNet mean/std normalisation.
  config.data.train_augment = TRAIN_AUGMENT
  config.data.eval_resize = "shorter_center_crop"  # Section 4.1's evaluation (and zero-shot's).
  config.optim.schedule.name = "cosine"
  config.optim.schedule.end_factor = 0.0
  config.optim.schedule.warmup_frac = WARMUP_FRAC
  config.optim.schedule.warmup_init_factor = WARMUP_INIT_FACTOR
  config.evals.eval.topk = (1, 5)
  if demo:
    # Same code path at laptop size: the demo's 32x32 images, a small model, a few minutes.
    config.data.image_size = DEMO_IMAGE_SIZE
    config.batch_size = demo_batch
    config.total_steps = demo_steps
    config.log_every_steps = 25
    config.eval_every_steps = demo_steps
    config.ckpt_every_steps = demo_steps
  else:
    config.data.image_size = 224
    config.data.num_workers = 16
    config.batch_size = paper_batch
    config.num_examples = arg.samples if arg.samples > 0 else PAPER_SAMPLES
    config.compute_dtype = "bfloat16"
    config.log_every_steps = 100
    config.eval_every_steps = 10_000
    config.ckpt_every_steps = 5_000
  if arg.samples > 0:
    config.total_steps = -1
    config.num_examples = arg.samples
  return common_fewshot.add(config, demo)
