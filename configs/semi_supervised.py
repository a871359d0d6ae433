r"""Billion-scale semi-supervised teacher/student (Yalniz et al. 2019, arXiv:1905.00546).

A teacher trained on the labelled set D ranks the unlabelled pool U; per image its top-P
classes are kept, per class the K best-scored images form D-hat; a student pretrains on D-hat,
then fine-tunes on D (the four stages of section 3.2). All stages, in sub-folders of DIR:

  python -m bigpretrain.tools.semi_supervised --config=configs/semi_supervised.py --workdir=DIR

Re-running the command skips finished stages and resumes an interrupted one; see
bigpretrain/semisup/semi_supervised.py. The sections `teacher`, `student`, `finetune` and `baseline`
are ordinary trainer configs (override e.g. `--config.student.total_steps=...`); `data`,
`infer`, `dedup` and `selection` feed the other stages; `rounds=2` makes the fine-tuned
student the next round's teacher (supplement section 3; section 4.2's text: +0.3% for a
second ResNet-50 round).

Paper scale (`--config=configs/semi_supervised.py:scale=paper,dataset=NAME,data_dir=DIR`):
the pool is read as `data.pool_splits` of the labelled dataset NAME (inference and the
`selection:DIR` source key images by (dataset, split, index)), e.g. a `folder:NAME` dataset
prepared with ImageNet as train/validation and YFCC100M as a split 'yfcc100m' under the same
class list. ResNeXt-101 32x48d teacher, ResNet-50 student, P = 10, K = 16k and 1B processed
images of pretraining (section 4.1, "Default parameters"); batch 1536 on 64 GPUs (24 per
GPU), weight decay 1e-4, lr 0.1 x batch / 256 reached by a warm-up from 0.1, halved at 13
equally spaced steps; fine-tuning at lr 0.00025 x batch / 256 with three equally spaced x0.1
steps over 30 epochs (section 4.1, "Training details"). BatchNorm statistics per 24 images
(`model.bn_group_size`; section 4.1: "Each GPU processes 24 images at a time and apply batch
normalization ... on each GPU"), in every stage whose model has BatchNorm; the groups are rows
of the global batch, so they hold on any mesh (SWAG's configs keep synchronised BN instead).
Deduplication (supplement section 5): before selection the pool loses its near-duplicates of
the evaluation sets, `dedup.against` (default at paper scale: NAME's validation split; add
e.g. a CUB-2011 split for transfer), the `dedup.top_n` = 5000 closest pool images ("The top
ranking 5000 YFCC images are removed"), by the L2-normalised pooled features of
`dedup.model` ('' = the teacher; the paper's is an ImageNet-trained ResNet-18); the paper
also reviewed the top pairs by hand, which DIR/dedup/<split>/dedup.json lists for review.
With several sets, top_n ranks the pool against all of them together (the paper removed 5000
for ImageNet and, separately, 218 for CUB2011; dedup.max_distance cuts every set alike).
Paper numbers (Table 2, ImageNet-1k val top-1): the ResNet-50 student reaches 75.9 after
pretraining on D-hat and 79.1 after fine-tuning, vs 76.4 for the supervised baseline;
ResNeXt-101 32x8d: 81.2 vs 79.1. Self-training (teacher = student = ResNet-50, Table 4): 77.6.

Teacher and baseline (`baseline=standard`, the default at paper scale): the paper gives
neither recipe; Table 2's 76.4 is a "fully-supervised" ResNet-50 trained "only on ImageNet",
and section 4.3 (Figure 4) finds that training it as long as the student does "did not help
much and in fact reduced accuracy". Both train on D with the standard ImageNet recipe of the
paper's [13] (Goyal et al.): 90 epochs, SGD lr 0.1 x batch / 256 after a 5-epoch linear
warm-up from 0.1, x0.1 at epochs 30, 60 and 80, weight decay 1e-4. `baseline=long` is the
Figure 4 reference instead: the student's pretraining recipe (13 halvings) for as many steps
as pretraining plus fine-tuning.

Choices where the paper is silent: SGD momentum 0.9, plain (not Nesterov), and the 5-epoch
warm-up, all from [13]; fine-tuning has no warm-up; the teacher's recipe (above).

Demo (no arg, about 7 minutes on 2 CPU cores): D = a seeded class-balanced 10% of the demo
train split (data.subset_frac; input_pipeline/subset.py, the draw SWAG fine-tuning uses too),
U = the `unlabeled` split plus the other 90% of train (its labels are never read: the
selection relabels it). The demo's 100
classes and 23k pool images scale P and K down: P = 10 as in the paper (10% of the classes
instead of 1%), K = 100 (the paper's K = 16k is 1.6% of its 1M images per class; on the demo
that would be 4 images, so K keeps ~43% of the ~230 pool images per class instead). Teacher
and student are both `vit_demo` (the paper's self-training variant, section 4.2 and Table 4): the
registry's smallest CNN, resnet18, trains at ~19 images/s on 2 CPU cores at 32x32 (vit_demo
at several hundred), too slow for a demo of five stages.
Demo lengths in steps of 128 images: teacher 300, student 150, fine-tuning 50 (baseline 200).
The demo keeps the schedules' shapes, not the paper's optimizer settings: 13 halvings in
120 teacher steps leave ~20 steps at a useful lr, and both SGD (lr 0.05) and AdamW (lr 2e-3)
ended there at ~4% top-1 on demo validation; AdamW at lr 2e-3, weight decay 0.05, with 3
halvings over 150 steps reached 13.4% (SGD with 3 halvings was not tried). So the demo uses
AdamW (lr 2e-3; 1e-4 for fine-tuning, with its three x0.1 steps) and 3 halvings. Its teacher
keeps the student's schedule shape and its baseline is `long` (equal steps): with teacher =
student = vit_demo a standard baseline would repeat the teacher run. Dedup is off on the demo
(`dedup=demo:validation` turns it on).

A pool from another prepared dataset NAME in the same data_dir: `pool=NAME` (U is its
data.pool_splits, default 'train'; only its images are read, so its labels may be in any
class list or none).

Semi-weakly supervised (`semi_weak`; sections 3.3 and 4.4, Table 6): the teacher is
pretrained on weakly supervised data W and fine-tuned on the labelled set ("the teacher
model obtained by pre-training on W followed by fine-tuning on V", section 3.3), and U is W
itself, `pool=hashtags:NAME` (split 'train'; its hashtags are never read: the teacher ranks
its images), with K = 64k ("Due to the larger size dataset, we use K = 64k", section 4.4);
P, the student and its schedules as above. Stages: DIR/round1/teacher_pretrain (hashtag
pretraining on data.pool), DIR/round1/teacher (fine-tuning on D from it), then as above.
  python -m bigpretrain.tools.semi_supervised --config=configs/semi_supervised.py:scale=paper,\
semi_weak,pool=hashtags:ig,data_dir=/data/tfds --workdir=/runs/semi_weak
`--config.teacher_pretrained=DIR` fine-tunes an existing hashtag run (e.g. one of
configs/swag_regnety.py) instead of the pretraining stage; `--config.teacher_workdir=DIR`
takes a teacher already fine-tuned. The paper's teacher is a ResNeXt-101 32x48d pretrained on
IG-1B-Targeted and fine-tuned on ImageNet following Mahajan et al. [27] (85.4% top-1), whose
recipe the paper does not give: the pretraining here is SWAG's (configs/swag_regnety.py's for
convnets, swag_vit.py's for ViTs; Singh et al. 2022 follow [27]: a softmax over each image's
hashtags), the fine-tuning configs/swag_finetune.py's on D. Paper numbers (Table 6, ImageNet
val top-1, semi-weakly / semi-supervised / weakly supervised [27]): ResNet-50 80.9 / 79.1 /
78.2 (81.2 semi-weakly with 2B images of pretraining: `--config.student.num_examples=
2000000000`); ResNeXt-101 32x4d 83.4 / 80.8 / 81.2, 32x8d 84.3 / 81.2 / 82.7, 32x16d 84.8 /
81.2 / 84.2. Demo (`semi_weak`, pool `hashtags:demo`; seeds against the plain demo in
docs/recipes.md):
  python -m bigpretrain.tools.semi_supervised --config=configs/semi_supervised.py:semi_weak \
    --workdir=/tmp/semi_weak
W = U = the demo's train images through their tags (D's images among them: in section 3.3 the
labelled data includes W); the teacher is vit_demo pretrained by configs/swag_vit.py's demo
(400 steps of 128) and fine-tuned on D by configs/swag_finetune.py's demo recipe (300 steps
of 64); K = 100 as in the plain demo.

Args: scale (demo | paper), dataset, data_dir, teacher, student (registry names; teacher=same
gives the student's architecture), p, k, variant (balanced_ranked | unbalanced_ranked;
unbalanced needs --config.selection.zipf_total or class_sizes; balanced_with_tags is the
selection job's alone, as the teacher's predictions carry no tags), baseline
(standard | long; '' = the scale's default), dedup (NAME:SPLIT[,...] evaluation sets, 'off',
or '' = the scale's default), pool (another dataset as U, above; '' = splits of `dataset`),
semi_weak (the semi-weakly supervised variant; needs pool at paper scale).
"""
import ml_collections

from bigpretrain import config_lib
from bigpretrain import models
from configs import common_fewshot
from configs import swag_finetune
from configs import swag_regnety
from configs import swag_vit
from input_pipeline import pipeline

PAPER_BATCH = 1536  # 64 GPUs x 24 images (section 4.1).
PAPER_BN_GROUP = 24  # BatchNorm "on each GPU" of 24 images (section 4.1).
PAPER_PRETRAIN_IMAGES = 1_000_000_000  # "#iter = 1B images" (section 4.1, Default parameters).
IMAGENET_TRAIN = 1_281_167
WARMUP_EPOCHS = 5  # Goyal et al. 2017, the paper's [13]; the paper gives no length.
FINETUNE_EPOCHS = 30.0
PAPER_TOP_P, PAPER_K = 10, 16_000  # Section 4.1.
NUM_HALVINGS = 13  # "the total number of reductions is 13".
DEMO_HALVINGS = 3
# The standard ImageNet recipe of [13] (Goyal et al.), the teacher's and the baseline's.
STANDARD_EPOCHS = 90.0
STANDARD_DECAY_EPOCHS = (30, 60, 80)
PAPER_DEDUP_TOP_N = 5000  # Supplement section 5: "The top ranking 5000 YFCC images".
BASELINES = ("standard", "long")
SEMI_WEAK_K = 64_000  # Section 4.4: "Due to the larger size dataset, we use K = 64k".
DEMO_POOL = "hashtags:demo"  # The semi-weakly supervised demo's W and U.


def _trainer(*, model: str, image_size: int, batch_size: int, lr: float) -> ml_collections.ConfigDict:
  """A softmax trainer config with SGD, momentum 0.9 ([13]), weight decay 1e-4 (section 4.1)."""
  c = config_lib.base_config()
  c.model = config_lib.model_section(name=model)
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


def standard_schedule(c, warmup_steps: int) -> None:
  """[13]'s ImageNet schedule: linear warm-up from 0.1 to lr, x0.1 at epochs 30, 60, 80 of
  90 (as fractions of the run, so a --config...num_epochs override keeps the shape)."""
  c.num_epochs = STANDARD_EPOCHS
  c.total_steps = -1
  c.num_examples = -1
  c.optim.schedule.name = "step"
  c.optim.schedule.warmup_steps = warmup_steps
  c.optim.schedule.warmup_init_factor = 256 / PAPER_BATCH
  c.optim.schedule.decay_factor = 0.1
  c.optim.schedule.decay_at = tuple(e / STANDARD_EPOCHS for e in STANDARD_DECAY_EPOCHS)


def finetune_schedule(c) -> None:
  """Three equally spaced x0.1 steps, no warm-up (section 4.1)."""
  c.optim.schedule.name = "step"
  c.optim.schedule.warmup_steps = 0
  c.optim.schedule.decay_factor = 0.1
  c.optim.schedule.num_decays = 3


def get_config(arg=None):
  arg = config_lib.parse_arg(arg, scale="demo", dataset="", data_dir="", teacher="",
                             student="", p=-1, k=-1, variant="balanced_ranked", baseline="",
                             dedup="", pool="", semi_weak=False)
  if arg.scale not in ("demo", "paper"):
    raise ValueError(f"config arg scale={arg.scale!r}: expected demo or paper.")
  demo = arg.scale == "demo"
  baseline = arg.baseline or ("long" if demo else "standard")
  if baseline not in BASELINES:
    raise ValueError(f"config arg baseline={arg.baseline!r}: expected one of {BASELINES}.")
  c = ml_collections.ConfigDict()
  c.seed = 0  # Every training stage's seed (the labelled draw has data.subset_seed).
  c.rounds = 1  # > 1: the fine-tuned student of round r is the teacher of round r + 1.
  c.run_baseline = True  # Also train the supervised baseline and report both numbers.
  c.teacher_workdir = ""  # An existing teacher run (or checkpoint) instead of the teacher stage.
  pool = arg.pool or (DEMO_POOL if demo and arg.semi_weak else "")
  if arg.semi_weak and not pool:
    raise ValueError("config arg semi_weak at paper scale needs pool=hashtags:NAME, the "
                     "weakly supervised dataset that pretrains the teacher and is ranked as U.")
  c.data = ml_collections.ConfigDict(dict(
      name=arg.dataset or ("demo" if demo else "tfds:imagenet2012"),
      dir=arg.data_dir,
      pool=pool,  # The dataset of pool_splits ('' = data.name; only its images are read).
      # D: data.subset_frac of train, drawn per class (1 = all of train is D).
      subset_frac=0.1 if demo else 1.0,
      subset_seed=0,
      # U: these splits of the same dataset, plus the rest of train when the subset is on.
      pool_splits=("train",) if pool else ("unlabeled",) if demo else ("yfcc100m",),
      pool_train_rest=demo and not pool,
  ))
  c.infer = ml_collections.ConfigDict(dict(
      top_p=arg.p if arg.p > 0 else PAPER_TOP_P, batch_size=256 if demo else 4096,
      shard_size=10_000 if demo else 1_000_000, logits=False, num_workers=0 if demo else 8,
      fsdp=1))
  dataset = c.data.name
  against = arg.dedup or ("off" if demo else f"{dataset}:validation")
  c.dedup = ml_collections.ConfigDict(dict(
      # Evaluation sets 'NAME:SPLIT[,...]' whose near-duplicates leave the pool ('' = off).
      against="" if against == "off" else against,
      model="",  # Checkpoint whose features compare images; '' = the (round-1) teacher.
      top_n=PAPER_DEDUP_TOP_N if not demo else 20,  # Per pool split; or max_distance >= 0.
      max_distance=-1.0, batch_size=256 if demo else 1024, ivf_threshold=1_000_000, nlist=0,
      nprobe=64, seed=0, fsdp=1, num_workers=0 if demo else 8))
  c.selection = ml_collections.ConfigDict(dict(
      k=arg.k if arg.k > 0 else (100 if demo else SEMI_WEAK_K if arg.semi_weak else PAPER_K),
      variant=arg.variant,
      class_sizes="", zipf_total=-1, zipf_exponent=1.0, seed=0,
      # The Beam runner ('' = Beam's FnApiRunner here) and its options, space-separated flags.
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
    c.student = _trainer(model=student, image_size=size, batch_size=batch, lr=lr)
    c.student.num_examples = PAPER_PRETRAIN_IMAGES
    c.finetune = _trainer(model=student, image_size=size, batch_size=batch,
                          lr=0.00025 * batch / 256)
    c.finetune.num_epochs = FINETUNE_EPOCHS
    for stage in (c.teacher, c.student, c.finetune):
      if models.accepts(stage.model.name, "bn_group_size"):
        stage.model.bn_group_size = PAPER_BN_GROUP
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
  pretrain_schedule(c.student, warmup)
  finetune_schedule(c.finetune)
  if demo:  # 13 halvings in 140 steps would leave ~20 steps at a useful lr.
    pretrain_schedule(c.teacher, warmup)
    c.teacher.optim.schedule.num_decays = c.student.optim.schedule.num_decays = DEMO_HALVINGS
  else:  # The paper gives no teacher recipe: the standard ImageNet one; or teacher_workdir.
    standard_schedule(c.teacher, warmup)
  # The supervised baseline: the student's architecture on D alone.
  c.baseline = ml_collections.ConfigDict(c.student.to_dict())
  c.baseline.num_examples = -1
  c.baseline.total_steps = -1
  if baseline == "standard":
    c.baseline.optim = ml_collections.ConfigDict(c.student.optim.to_dict())
    standard_schedule(c.baseline, warmup)
  # 'long': total_steps -1 = the student's pretraining steps plus its fine-tuning steps.
  if arg.semi_weak:
    semi_weak_teacher(c, teacher, demo)
  return c


def semi_weak_teacher(c, model: str, demo: bool) -> None:
  """The teacher of section 4.4: hashtag pretraining on data.pool (SWAG's recipe, ViT or
  convnet), then SWAG fine-tuning on D, from the pretraining's weights (section 3.3)."""
  pretrain = swag_vit if model.startswith("vit") else swag_regnety
  c.teacher_pretrain = pretrain.get_config(
      f"dataset={c.data.pool},data_dir={c.data.dir},model={model}")
  c.teacher_pretrained = ""  # An existing hashtag run instead of the teacher_pretrain stage.
  size = "small" if demo else swag_finetune.size_of(IMAGENET_TRAIN)
  teacher = swag_finetune.get_config(
      f"dataset={'demo' if demo else c.data.name},data_dir={c.data.dir},model={model},"
      f"size={size}")
  teacher.model = ml_collections.ConfigDict(c.teacher_pretrain.model.to_dict())
  if teacher.model.get("pre_logits"):
    teacher.model.pre_logits = False  # As swag_finetune drops the tanh layer.
  common_fewshot.add(teacher, demo)
  c.teacher = teacher
