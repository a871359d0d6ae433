r"""Billion-scale semi-supervised teacher/student (Yalniz et al. 2019, arXiv:1905.00546).

A teacher trained on the labelled set D ranks the unlabelled pool U; per image its top-P
classes are kept, per class the K best-scored images form D-hat (section 3.2); a student
pretrains on D-hat, then fine-tunes on D (section 3.1). All stages, in sub-folders of DIR:

  python -m bigpretrain.tools.semi_supervised --config=configs/semi_supervised.py --workdir=DIR

Re-running the command skips finished stages and resumes an interrupted one; see
bigpretrain/semi_supervised.py. The sections `teacher`, `student`, `finetune` and `baseline`
are ordinary trainer configs (override e.g. `--config.student.total_steps=...`); `data`,
`infer` and `selection` feed the other stages; `rounds=2` makes the fine-tuned student the
next round's teacher (supplement section 3; Table 4: +0.3% for a second ResNet-50 round).

Paper scale (`--config=configs/semi_supervised.py:scale=paper,dataset=NAME,data_dir=DIR`):
the pool is read as `data.pool_splits` of the labelled dataset NAME (inference and the
`selection:DIR` source key images by (dataset, split, index)), e.g. a `folder:NAME` dataset
prepared with ImageNet as train/validation and YFCC100M as a split 'yfcc100m' under the same
class list. ResNeXt-101 32x48d teacher, ResNet-50 student, P = 10, K = 16k (section 4.1),
1B processed images of pretraining, batch 1536 on 64 GPUs (24 per GPU), SGD momentum 0.9,
weight decay 1e-4, lr 0.1 x batch / 256 reached by a warm-up from 0.1, halved at 13 equally
spaced steps; fine-tuning at lr 0.00025 x batch / 256
with three equally spaced x0.1 steps over 30 epochs ("Training details", section 4.1).
Paper numbers (Table 2, ImageNet-1k val top-1): the ResNet-50 student reaches 75.9 after
pretraining on D-hat and 79.1 after fine-tuning, vs 76.4 for the supervised baseline;
ResNeXt-101 32x8d: 81.2 vs 79.1. Self-training (teacher = student = ResNet-50, Table 4): 77.6.

Choices where the paper is silent: the warm-up lasts 5 ImageNet epochs (Goyal et al., the
paper's [13]), plain (not Nesterov) momentum as in [13]; fine-tuning has no warm-up; the
supervised baseline trains the student architecture on D alone for as many steps as
pretraining plus fine-tuning, with the pretraining optimizer and schedule.

Demo (no arg, about 7 minutes on 2 CPU cores): D = a seeded class-balanced 10% of the demo
train split (data.subset_frac; input_pipeline/subset.py, the draw SWAG fine-tuning uses too),
U = the `unlabeled` split plus the other 90% of train (its labels are never read: the
selection relabels it). The demo's 100
classes and 23k pool images scale P and K down: P = 10 as in the paper (10% of the classes
instead of 1%), K = 100 (the paper's K = 16k is 1.6% of its 1M images per class; on the demo
that would be 4 images, so K keeps ~43% of the ~230 pool images per class instead). Teacher
and student are both `vit_demo` (the paper's self-training variant, section 4.3): the
registry's smallest CNN, resnet18, trains at ~19 images/s on 2 CPU cores at 32x32 (vit_demo
at ~180), too slow for a demo of five stages.
Demo lengths in steps of 128 images: teacher 300, student 150, fine-tuning 50 (baseline 200).
The demo keeps the schedules' shapes, not the paper's optimizer settings: 13 halvings in
120 teacher steps leave ~20 steps at a useful lr, and both SGD (lr 0.05) and AdamW (lr 2e-3)
ended there at ~4% top-1 on demo validation; AdamW at lr 2e-3, weight decay 0.05, with 3
halvings over 150 steps reached 13.4% (SGD with 3 halvings was not tried). So the demo uses
AdamW (lr 2e-3; 1e-4 for fine-tuning, with its three x0.1 steps) and 3 halvings.

Args: scale (demo | paper), dataset, data_dir, teacher, student (registry names; teacher=same
gives the student's architecture), p, k, variant (balanced_ranked | unbalanced_ranked |
balanced_with_tags; unbalanced needs --config.selection.zipf_total or class_sizes).
"""
import ml_collections

from bigpretrain import config_lib
from configs import common_fewshot
from input_pipeline import pipeline

PAPER_BATCH = 1536  # 64 GPUs x 24 images (section 4.1).
PAPER_PRETRAIN_IMAGES = 1_000_000_000  # "1 billion iterations" (section 4.4, Figure 4).
IMAGENET_TRAIN = 1_281_167
WARMUP_EPOCHS = 5  # Goyal et al. 2017, the paper's [13]; the paper gives no length.
FINETUNE_EPOCHS = 30.0
PAPER_TOP_P, PAPER_K = 10, 16_000  # Section 4.1.
NUM_HALVINGS = 13  # "the total number of reductions is 13".
DEMO_HALVINGS = 3


def _trainer(*, model: str, image_size: int, batch_size: int, lr: float) -> ml_collections.ConfigDict:
  """A softmax trainer config with the paper's SGD (momentum 0.9, weight decay 1e-4)."""
  c = config_lib.base_config()
  c.model = dict(name=model)
  c.data = pipeline.data_defaults()
  c.data.image_size = image_size
  c.batch_size = batch_size
  c.optim.name = "sgd"
  c.optim.momentum = 0.9
  c.optim.nesterov = False
  c.optim.weight_decay = 1e-4
  c.optim.lr = lr
  return c


def _demo_optimizer(c) -> None:
  """AdamW for the demo's small ViT: with SGD it reached 4.4% top-1 on D in 120 steps."""
  c.optim.name = "adamw"
  c.optim.weight_decay = 0.05


def pretrain_schedule(c, warmup_steps: int) -> None:
  """Linear warm-up from lr x 256 / 1536 (the paper's 0.1 -> 0.6) to lr, then 13 halvings
  equally spaced over the rest of the run."""
  c.optim.schedule.name = "step"
  c.optim.schedule.warmup_steps = warmup_steps
  c.optim.schedule.warmup_init_factor = 256 / PAPER_BATCH
  c.optim.schedule.decay_factor = 0.5
  c.optim.schedule.num_decays = NUM_HALVINGS


def finetune_schedule(c) -> None:
  """Three equally spaced x0.1 steps, no warm-up (section 4.1)."""
  c.optim.schedule.name = "step"
  c.optim.schedule.warmup_steps = 0
  c.optim.schedule.decay_factor = 0.1
  c.optim.schedule.num_decays = 3


def get_config(arg=None):
  arg = config_lib.parse_arg(arg, scale="demo", dataset="", data_dir="", teacher="",
                             student="", p=-1, k=-1, variant="balanced_ranked")
  if arg.scale not in ("demo", "paper"):
    raise ValueError(f"config arg scale={arg.scale!r}: expected demo or paper.")
  demo = arg.scale == "demo"
  c = ml_collections.ConfigDict()
  c.seed = 0  # Every training stage's seed (the labelled draw has data.subset_seed).
  c.rounds = 1  # > 1: the fine-tuned student of round r is the teacher of round r + 1.
  c.run_baseline = True  # Also train the supervised baseline and report both numbers.
  c.teacher_workdir = ""  # An existing teacher run (or checkpoint) instead of the teacher stage.
  c.data = ml_collections.ConfigDict(dict(
      name=arg.dataset or ("demo" if demo else "tfds:imagenet2012"),
      dir=arg.data_dir,
      # D: data.subset_frac of train, drawn per class (1 = all of train is D).
      subset_frac=0.1 if demo else 1.0,
      subset_seed=0,
      # U: these splits of the same dataset, plus the rest of train when the subset is on.
      pool_splits=("unlabeled",) if demo else ("yfcc100m",),
      pool_train_rest=demo,
  ))
  c.infer = ml_collections.ConfigDict(dict(
      top_p=arg.p if arg.p > 0 else PAPER_TOP_P, batch_size=256 if demo else 4096,
      shard_size=10_000 if demo else 1_000_000, logits=False, num_workers=0 if demo else 8,
      fsdp=1))
  c.selection = ml_collections.ConfigDict(dict(
      k=arg.k if arg.k > 0 else (100 if demo else PAPER_K), variant=arg.variant,
      class_sizes="", zipf_total=-1, zipf_exponent=1.0, seed=0,
      # The Beam runner ('' = DirectRunner here) and its options, space-separated flags.
      beam_runner="", beam_options=""))

  student = arg.student or ("vit_demo" if demo else "resnet50")
  teacher = arg.teacher or ("vit_demo" if demo else "resnext101_32x48d")
  if teacher == "same":
    teacher = student
  if demo:
    size, batch = 32, 128
    c.teacher = _trainer(model=teacher, image_size=size, batch_size=batch, lr=2e-3)
    c.teacher.total_steps = 300  # Stronger than the baseline student, as in the paper.
    c.student = _trainer(model=student, image_size=size, batch_size=batch, lr=2e-3)
    c.student.total_steps = 150
    c.finetune = _trainer(model=student, image_size=size, batch_size=batch, lr=1e-4)
    c.finetune.total_steps = 50
    for stage in (c.teacher, c.student, c.finetune):
      _demo_optimizer(stage)
    warmup = 10
  else:
    size, batch = 224, PAPER_BATCH
    lr = 0.1 * batch / 256
    c.teacher = _trainer(model=teacher, image_size=size, batch_size=batch, lr=lr)
    c.teacher.num_epochs = 90.0  # A standard ImageNet run; or pass teacher_workdir.
    c.student = _trainer(model=student, image_size=size, batch_size=batch, lr=lr)
    c.student.num_examples = PAPER_PRETRAIN_IMAGES
    c.finetune = _trainer(model=student, image_size=size, batch_size=batch,
                          lr=0.00025 * batch / 256)
    c.finetune.num_epochs = FINETUNE_EPOCHS
    warmup = round(WARMUP_EPOCHS * IMAGENET_TRAIN / batch)
  for stage in (c.teacher, c.student, c.finetune):
    common_fewshot.add(stage, demo)
    if demo:
      stage.log_every_steps, stage.eval_every_steps, stage.ckpt_every_steps = 25, 0, 50
    else:
      stage.data.train_augment = "inception_crop|flip"
      stage.data.eval_resize = "center_crop"
      stage.data.normalize = "imagenet"
      stage.data.num_workers = 8
      stage.compute_dtype = "bfloat16"
      stage.log_every_steps, stage.eval_every_steps, stage.ckpt_every_steps = 100, 10_000, 5_000
  pretrain_schedule(c.teacher, warmup)
  pretrain_schedule(c.student, warmup)
  finetune_schedule(c.finetune)
  if demo:  # 13 halvings in 140 steps would leave ~20 steps at a useful lr.
    c.teacher.optim.schedule.num_decays = c.student.optim.schedule.num_decays = DEMO_HALVINGS
  # The supervised baseline: the student's architecture and pretraining recipe on D alone;
  # total_steps -1 = the student's pretraining steps plus its fine-tuning steps.
  c.baseline = ml_collections.ConfigDict(c.student.to_dict())
  c.baseline.num_examples = -1
  c.baseline.total_steps = -1
  return c
