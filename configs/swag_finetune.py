r"""Fine-tuning the SWAG way (Singh et al., "Revisiting Weakly Supervised Pre-Training of Visual
Perception Models", CVPR 2022, section 4.1 "Finetuning", section 4.2 / Table 2), from a hashtag
checkpoint (configs/swag_regnety.py, configs/swag_vit.py) or any recipe's checkpoint; with no
`init` the same recipe from scratch, the baseline a pre-training has to beat.

Demo (no arg: the embedded `demo` dataset, 20,000 train images, "small" by the paper's rule;
32x32, regnety_demo as configs/swag_regnety.py; about two minutes on a 2-core CPU):
  python -m bigpretrain.main --config=configs/swag_finetune.py --workdir=/tmp/swag_ft_scratch
  From the demo hashtag pre-training (model, image size and normalisation come from the
  checkpoint), then the 1% few-shot run with the zero-shot-initialised head:
  python -m bigpretrain.main --config=configs/swag_finetune.py:init=/tmp/swag_regnety \
    --workdir=/tmp/swag_ft
  python -m bigpretrain.main \
    --config=configs/swag_finetune.py:init=/tmp/swag_regnety,fewshot=0.01,zs_head \
    --workdir=/tmp/swag_ft_1pct
The demo override (the recipe is otherwise the paper's): batch 64 (not 512), 300 steps (not
500), lr DEMO_LR, EMA momentum 1 - 2 / steps (the paper's 0.9999 over its 20,000 steps keeps
e^-2 of the start; the demo keeps the same share over its own run).

Paper scale (ImageNet-1k as ArrayRecord, from a RegNetY-16GF hashtag checkpoint):
  python -m bigpretrain.main --config=configs/swag_finetune.py:dataset=tfds:imagenet2012,\
data_dir=/data/tfds,init=/runs/swag_regnety_16gf --workdir=/runs/swag_ft_in1k
  few-shot: add `fewshot=0.01` (or 0.1) and `zs_head` for the ZS-Init.+Ft. rows.
Hardware: 8 V100 nodes; the pre-training used 128 V100s (section 3.2, appendix B).
Paper numbers: Table 1, ImageNet-1k top-1 after fine-tuning at 384 px: RegNetY 16GF 86.0,
32GF 86.8, 128GF 88.2; ViT B/16 85.3, L/16 88.1, H/14 88.6. Table 2, at 224 px, on 1% / 10% /
100% of ImageNet-1k: RegNetY 16GF fine-tuned 72.3 / 80.4 / 85.3, ZS-Init.+Ft. 77.6 / 80.8 /
85.7; 128GF 79.2 / 84.1 / 87.9 and 82.0 / 84.5 / 87.8.

Recipe (section 4.1): SGD, batch 512, half-cosine schedule to 0 and no warm-up (none is
mentioned), no weight decay, mixup alpha 0.1 on every dataset, sync BatchNorm (the trainer's
batch statistics are global; a checkpoint's own BN grouping, e.g. the semi-supervised
recipe's 24 images, is not carried over), eval by resizing the shorter side to the image
size and taking the centre crop (`shorter_center_crop`). Length by the train split's size
N: 500 steps for N <= 20,000 ("small"), 10,000 for N <= 500,000 ("medium"), 20,000 above
("large"); a few-shot draw counts as its own N (1% of ImageNet-1k is small, 10% medium);
ViTs on the whole of ImageNet-1k train VIT_IN1K_EPOCHS = 28 epochs instead ("we finetuned
ViTs for 28 epochs on ImageNet-1k"). EMA of the weights with "decay 1e-4", i.e. momentum
0.9999 (ClassyVision's hook averages params and BatchNorm statistics), used for eval; the
paper uses it for ImageNet-1k only ("For ImageNet-1k finetuning, we additionally compute an
exponential moving average"), so here it is on for ImageNet-1k at the "large" length and off
otherwise unless `ema=` says (0.9999 over a few-shot draw's 500 steps would leave the EMA at
95% of the starting weights).
Resolution (section 4.1, Table 1 "Fine." column): RegNetY and ViT B/16 at 384, ViT L/16 at
512, ViT H/14 at 518 (FINETUNE_RES); Table 2's runs (few-shot draws and the zero-shot-
initialised head) are "at 224x224", the pre-training's, as is any model the paper does not
list. `res=` overrides. The model is built at this resolution (not the checkpoint's) and
model_init resizes a ViT checkpoint's position embedding to its grid, bicubic with
align_corners as SWAG's trainer does (ClassyVision's VisionTransformer, which torchvision's
interpolate_embeddings follows; CLASSY_RESIZE); a converted checkpoint's as its library does.
lr (appendix D, Table 8, base lr per model and task at the paper's batch of 512, scaled
linearly with the batch): the IG 3.6B rows in Table 1's order (the extracted table lost its
model column), columns ImageNet-1k, ImageNet-5k, iNaturalist, Places365, CUB-2011; `task=`
picks the column (auto: from the tfds name, or ImageNet-1k by its class list under any
name; a dataset with one of the five's class count that neither identifies is refused,
pass `task=`; `task=other` or any other dataset: ImageNet-1k's lr and the step rule).
The fine-tuned ViT drops the hashtag model's tanh representation layer (pre_logits): Table 5
counts ViT B/16, L/16, H/14 at 86.6 / 304.3 / 632.0M parameters with a 1k head, which is
without it; with `zs_head` it is kept, since the zero-shot head is defined on its output.
Choices the paper leaves open: momentum 0.9 with Nesterov (the pre-training's SGD; BiT, which
the paper follows, uses momentum 0.9); random-resized crop + flip for training, the
pre-training's augmentation.

Args: dataset, data_dir, init (checkpoint dir -> config.model_init; its meta sets the model,
normalisation and pre-training image size, not the BN grouping), model (without init;
default regnety_demo on the demo, regnety_16gf otherwise), fewshot (data.subset_frac: 0.01,
0.1; 1 = all), fewshot_seed, zs_head (config.model_init_head='zero_shot'), ema (-1: by size as
above), lr (-1: Table 8 as above; at config.batch_size), size (auto | small | medium | large),
res (-1: as above; pixels otherwise), task (auto | in1k | in5k | inat | places | cub | other).
"""
import pathlib

from bigpretrain import checkpoint
from bigpretrain import config_lib
from bigpretrain import semantic
from configs import common_fewshot
from input_pipeline import datasets
from input_pipeline import pipeline

PAPER_BATCH = 512
MIXUP_ALPHA = 0.1
EMA_MOMENTUM = 0.9999  # "decay rate of 1e-4".
STEPS = {"small": 500, "medium": 10_000, "large": 20_000}
SMALL_MAX, MEDIUM_MAX = 20_000, 500_000  # N <= 20k small, <= 500k medium, else large.
VIT_IN1K_EPOCHS = 28  # Section 4.1: ViTs on ImageNet-1k.
IN1K_TRAIN = 1_281_167  # ImageNet-1k's train split (for eval/ckpt intervals of the 28 epochs).
TABLE2_RES = 224  # Section 4.2: "We report results using images of size 224x224 pixels".
# Section 4.1 / Table 1 "Fine." column: the fine-tuning resolution of each IG 3.6B model.
FINETUNE_RES = {"regnety_16gf": 384, "regnety_32gf": 384, "regnety_128gf": 384,
                "vit_b16": 384, "vit_l16": 512, "vit_h14": 518}
TASKS = ("in1k", "in5k", "inat", "places", "cub")  # Table 8's columns.
# Their datasets' class counts (ImageNet-1k/5k, iNaturalist 2018, Places365, CUB-2011).
TASK_CLASSES = {"in1k": 1000, "in5k": 5000, "inat": 8142, "places": 365, "cub": 200}
OTHER = "other"  # A dataset that is none of Table 8's: PAPER_LR and the step rule.
IN1K_WNIDS = pathlib.Path(semantic.__file__).parent / "data" / "imagenet1k_wnids.txt"
# The position-embedding resize of SWAG's trainer, ClassyVision (models.vit.RESIZE_METHODS).
CLASSY_RESIZE = "bicubic_align_corners"
# Table 8, IG 3.6B rows (in Table 1's order), base lr at PAPER_BATCH per task in TASKS.
TABLE8_LR = {
    "vit_h14": (6e-3, 2.4e-2, 1.2e-2, 3e-3, 6e-3),
    "vit_l16": (6e-3, 2.4e-2, 1.2e-2, 3e-3, 3e-3),
    "vit_b16": (6e-3, 2.4e-2, 1.2e-2, 3e-3, 3e-3),
    "regnety_128gf": (6e-3, 2.4e-2, 1.2e-2, 6e-3, 3e-3),
    "regnety_32gf": (6e-3, 1.2e-2, 1.2e-2, 1.2e-2, 6e-3),
    "regnety_16gf": (6e-3, 1.2e-2, 1.2e-2, 1.2e-2, 6e-3),
}
PAPER_LR = 6e-3  # Table 8's ImageNet-1k column (every IG 3.6B model): the default elsewhere.
# tfds names of Table 8's datasets (ImageNet-5k has none).
TFDS_TASKS = {"imagenet2012": "in1k", "i_naturalist2018": "inat", "places365_small": "places",
              "caltech_birds2011": "cub"}
TRAIN_AUGMENT = "inception_crop|flip"
DEMO_MODEL, PAPER_MODEL = "regnety_demo", "regnety_16gf"  # As configs/swag_regnety.py.
DEMO_BATCH, DEMO_STEPS, DEMO_LR, DEMO_IMAGE_SIZE = 64, 300, 0.01, 32


def size_of(num_train: int) -> str:
  """The paper's dataset size class of a train split of num_train examples."""
  if num_train <= SMALL_MAX:
    return "small"
  return "medium" if num_train <= MEDIUM_MAX else "large"


def task_of(dataset: str) -> str:
  """Table 8's column for a dataset name ('tfds:imagenet2012' -> 'in1k'); '' if not listed."""
  name = dataset.split(":", 1)[-1].split("/", 1)[0].split(":", 1)[0]
  return TFDS_TASKS.get(name, "")


def task_from_classes(dataset: str, info) -> str:
  """Table 8's column for a dataset its name does not give (task_of): ImageNet-1k by its
  class list (the 1,000 wnids, under any name), else OTHER; raises for a dataset with a
  Table 8 dataset's class count that its class list does not identify."""
  if list(info.class_names) == IN1K_WNIDS.read_text().split():
    return "in1k"
  like = [t for t, n in TASK_CLASSES.items() if n == info.num_classes]
  if like:
    raise ValueError(f"task=auto: {dataset} has {info.num_classes} classes, as Table 8's "
                     f"{like[0]} dataset, but neither its name nor its class list says it "
                     f"is; pass task={like[0]} or task={OTHER}.")
  return OTHER


def table8_lr(model: str, task: str) -> float:
  """Table 8's base lr (at PAPER_BATCH) for a model and task; PAPER_LR where it has none."""
  if task not in TASKS:
    return PAPER_LR
  return TABLE8_LR.get(model, (PAPER_LR,) * len(TASKS))[TASKS.index(task)]


def get_config(arg=None):
  """SWAG fine-tuning; `arg` e.g. 'init=/runs/swag_regnety,fewshot=0.01,zs_head'."""
  arg = config_lib.parse_arg(arg, dataset="demo", data_dir="", init="", model="",
                             fewshot=1.0, fewshot_seed=0, zs_head=False, ema=-1.0, lr=-1.0,
                             size="auto", res=-1, task="auto")
  demo = arg.dataset == "demo"
  if arg.task not in ("auto",) + TASKS + (OTHER,):
    raise ValueError(f"task={arg.task!r} must be auto, {OTHER} or one of {TASKS}.")
  config = config_lib.base_config()
  config.data = pipeline.data_defaults()
  config.data.name = arg.dataset
  config.data.dir = arg.data_dir
  config.data.subset_frac = arg.fewshot
  config.data.subset_seed = arg.fewshot_seed
  config.data.train_augment = TRAIN_AUGMENT
  config.data.eval_resize = "shorter_center_crop"
  config.data.normalize = "imagenet"  # ClassyVision's; a checkpoint's own wins below.
  pretrain_res = DEMO_IMAGE_SIZE if demo else TABLE2_RES
  if arg.init:
    if arg.model:
      raise ValueError(f"model={arg.model!r} and init={arg.init!r}: the checkpoint sets the "
                       "model; leave model out.")
    meta = checkpoint.read_meta(arg.init)
    # Built at this run's resolution, with synchronised BN whatever the checkpoint used.
    config.model = config_lib.finetune_model_section(meta["model"])
    # SWAG's own resize for a bigpretrain run's checkpoint; a converted one keeps its
    # library's (auto).
    config.model_init_resize = "auto" if meta.get("source") else CLASSY_RESIZE
    config.data.normalize = meta["data"]["normalize"]
    pretrain_res = meta["data"]["image_size"]
    if config.model.get("pre_logits") and not arg.zs_head:
      config.model.pre_logits = False  # Table 5's fine-tuned ViTs have no tanh layer.
  else:
    config.model = config_lib.model_section(name=arg.model or (DEMO_MODEL if demo else PAPER_MODEL))
    if config.model.name.startswith("regnety"):  # As the hashtag RegNetYs (swag_regnety.py).
      config.model.zero_init_residual = False
  model = config.model.name
  table2 = arg.fewshot != 1.0 or arg.zs_head
  if arg.res > 0:
    config.data.image_size = arg.res
  elif demo or table2:
    config.data.image_size = pretrain_res
  else:
    config.data.image_size = FINETUNE_RES.get(model, pretrain_res)
  config.model_init = arg.init
  config.model_init_head = "zero_shot" if arg.zs_head else ""
  config.objective = dict(name="softmax", label_smoothing=0.0)
  config.mixup = dict(mixup_alpha=MIXUP_ALPHA, cutmix_alpha=0.0, switch_prob=0.5,
                      label_smoothing=0.0)
  config.optim.name = "sgd"
  config.optim.momentum = 0.9
  config.optim.nesterov = True
  config.optim.weight_decay = 0.0
  config.optim.schedule.name = "cosine"
  config.optim.schedule.end_factor = 0.0
  config.evals.eval.topk = (1, 5)

  if arg.size not in ("auto",) + tuple(STEPS):
    raise ValueError(f"size={arg.size!r} must be auto, small, medium or large.")
  if demo:
    config.batch_size = DEMO_BATCH
    config.total_steps = DEMO_STEPS
    lr_at_batch, lr_batch = DEMO_LR, DEMO_BATCH
    config.log_every_steps = 25
    config.eval_every_steps = 100
    config.ckpt_every_steps = DEMO_STEPS
    ema = 1.0 - 2.0 / DEMO_STEPS
  else:
    size, task = arg.size, arg.task

    def info():
      return datasets.get_dataset({"name": arg.dataset, "dir": arg.data_dir}).info

    if size == "auto":
      size = size_of(round(info().num_examples[config.data.train_split] * arg.fewshot))
    if task == "auto":
      task = task_of(arg.dataset) or task_from_classes(arg.dataset, info())
    config.batch_size = PAPER_BATCH
    lr_at_batch, lr_batch = table8_lr(model, task), PAPER_BATCH
    config.compute_dtype = "bfloat16"
    config.data.num_workers = 16
    config.log_every_steps = 50
    config.ckpt_every_steps = 1_000
    if model.startswith("vit") and task == "in1k" and arg.fewshot == 1.0:
      config.num_epochs = float(VIT_IN1K_EPOCHS)
      steps = -(-VIT_IN1K_EPOCHS * IN1K_TRAIN // PAPER_BATCH)
    else:
      config.total_steps = steps = STEPS[size]
    config.eval_every_steps = max(steps // 4, 250)
    ema = EMA_MOMENTUM if task == "in1k" and size == "large" else 0.0
  config.ema.momentum = ema if arg.ema < 0 else arg.ema
  if arg.lr > 0:
    lr_at_batch, lr_batch = arg.lr, None
  # Linear in the batch, by reference: a --config.batch_size override rescales it.
  batch = config.get_ref("batch_size")
  config.optim.lr = (lr_at_batch if lr_batch is None
                     else lr_at_batch * batch.to_float() / float(lr_batch))
  return common_fewshot.add(config, demo)
