r"""Transfer a pretrained checkpoint to a dataset: fine-tune, linear probe or few-shot.

  python -m bigpretrain.main --config=configs/transfer.py:mode=MODE,init=DIR[,dataset=NAME,...]

`init` is any bigpretrain checkpoint (a run's workdir, its checkpoints/ folder or a
`bigpretrain.tools.convert` output); the model, its image size (`res=` picks another: the model
is built at it and model_init resizes a ViT's position embedding, by RECIPE_RESIZE for a
bigpretrain checkpoint, as its library does for a converted one) and its input normalisation
come from the checkpoint's meta; its BatchNorm grouping does not (the recipe's, below); the
class count comes from the dataset, and the classifier head always starts fresh
(model_init_skip='^params/head/'). `dataset` is any prepared dataset
name (tfds:NAME, folder:NAME, imagenet21k_p, demo, ...); the default, `demo_coarse`, is the
demo's second task: demo images labelled one WordNet level up (12 classes,
input_pipeline/sources/demo_coarse.py).

Modes:
- finetune: the whole network trained by a named recipe (`recipe=`):
  - in21k (default): the ImageNet-21K-P paper's downstream fine-tuning (Ridnik et al. 2021,
    section 4.2; its appendix D is not in our copy of the paper, so the values are the
    authors' own command for reproducing the article's transfer results, Transfer_learning.md
    in Alibaba-MIIL/ImageNet21K, a timm run): Adam with coupled weight decay 1e-4, lr 2e-4 at
    batch 128, 50 epochs, cosine to 1e-8 after 3 warm-up epochs, label smoothing 0.1, EMA
    of the weights 0.995, squish resize to 224 for train and eval. Their augmentation is
    timm's AutoAugment v0 and random erasing 0.5, which bigpretrain lacks: the pretraining's
    RandAugment + Cutout stand in (the recipe's own augmentations, configs/semantic_softmax.py).
    BatchNorm statistics over the whole batch (the command states none). `multi_label`
    trains with ASL and logs eval/mAP: the paper reports its multi-label transfers as mAP
    (Table 2, also Tables 3-4: MS-COCO and Pascal-VOC) and finds ASL better than
    cross-entropy for multi-label training up- and downstream (section 3.2; the VOC year and
    appendix D's settings are not in our copy). Supported on a dataset whose records carry
    their classes as an id list: a tfds dataset with a top-level Sequence(ClassLabel)
    'labels' and no 'label' (Pascal-VOC as tfds prepares it, e.g. `dataset=tfds:voc/2007`:
    each image's distinct object classes; its 'labels_no_difficult' by
    --config.objective.field=labels_no_difficult) or a hashtag dataset ('hashtag_ids');
    the config reads the dataset's info and sets objective.field (multi_label.py) to that
    field. MS-COCO is not supported as tfds prepares it: tfds coco/2017 has no 'labels',
    only per-object 'objects/label' (repeats, nested in 'objects'), which the pipeline does
    not ship; it needs each image's object labels gathered into a top-level 'labels'
    Sequence(ClassLabel) in a re-prepared dataset first. On a single-label dataset with
    WordNet class names (the demo's) multi_label instead takes label + ancestors (below).
  - swag: configs/swag_finetune.py's values (Singh et al. 2022, section 4.1: SGD, no weight
    decay, mixup 0.1, EMA on ImageNet-1k, shorter-side centre-crop eval, a ViT without its
    tanh representation layer, Table 8's lr for the checkpoint's model), at the checkpoint's
    resolution (swag_finetune.py itself
    moves to Table 1's 384-518 px).
  - cosub: configs/cosub_finetune_in1k.py's values (Touvron et al. 2023, supplement A.1:
    LAMB, LayerDecay, cosub on); ViT models only.
  - semisup_cub: the billion-scale semi-supervised paper's CUB-2011 "full-ft" (Yalniz et al.
    2019, supplement section 6, Table 13, "same settings ... for different kinds of
    supervision and models"): SGD, lr 0.0025 x batch / 256 at its batch 768 (32 GPUs x 24),
    300 epochs with the lr x0.1 every 100 ("[100] x 3"; decay 0.1, supplement 4.2), weight
    decay 0.001. Not in Table 13, so ImageNet practice: momentum 0.9, no warm-up,
    random-resized crop + flip at 224, shorter side 256 + centre crop for eval. BatchNorm per
    24 images at paper scale (SEMISUP_CUB_BN_GROUP: 768 on 32 GPUs, and section 4.1's "batch
    normalization ... on each GPU"; the demo's batch keeps whole-batch statistics). Paper numbers
    (Table 8, ResNet-50 on CUB-2011): 82.1 from ImageNet, 83.6 semi-supervised, 84.8
    semi-weakly supervised.
- linear: a linear classifier on frozen pooled features (model.features(), eval mode) of the
  whole train split (bigpretrain/evaluators/linear_probe.py), `classifier=`: ridge (default), in closed
  form, chosen over SGD on a frozen backbone because it is exact and has no lr/epoch grid,
  and because the eval-mode features keep BatchNorm statistics frozen, which the trainer's
  train-mode forward would update; or logistic, multinomial logistic regression by L-BFGS,
  the paper 002 "fc-only" probe (Table 8: ResNet-50 on CUB-2011, 73.3 from ImageNet, 80.4
  semi-supervised, 80.7 semi-weakly). No training step runs (total_steps=0); the row
  'linear/top1' is written to metrics.jsonl, and config.evals.linear.classifier says which.
- fewshot: k-shot ridge regression on frozen features (big_vision's few-shot evaluator), 1,
  5, 10 and 25 shots per class drawn from the train split, mean over 3 seeds, scored on the
  eval split; total_steps=0, rows 'fewshot/<dataset>_<k>shot'. Regulariser: big_vision's
  2^10, or configs/common_fewshot.DEMO_L2_REG on the demo's datasets (why: see there).

Demo (after a demo pretraining, e.g. configs/semantic_softmax.py into /tmp/ss_demo):
  for m in finetune linear fewshot; do python -m bigpretrain.main \
    --config=configs/transfer.py:mode=$m,init=/tmp/ss_demo --workdir=/tmp/transfer_$m; done
Fine-tuning on the demo's datasets uses demo-sized runs (batch 64, DEMO_STEPS steps; the
in21k recipe at DEMO_LR, its 2e-4 being too low for 300 steps of a small ViT).
Multi-label with mAP: `...:mode=finetune,init=/tmp/ss_demo,multi_label` trains with ASL
(objective multi_label: an image's positives are its class and the class's WordNet
ancestors among the dataset's classes: on demo_coarse, whose 12 classes are all at level 1,
the class alone; on demo_plain_coarse a level-1 class and its root) and logs eval/mAP.
`dataset=hashtags:demo,multi_label` is the demo of the id-list case: the demo's images with
their hashtags as labels (objective.field='hashtag_ids'), a demo-sized run.

Args: mode (finetune | linear | fewshot), init (checkpoint; required but for
finetune with model=, the from-scratch baseline), dataset, data_dir, recipe (in21k | swag |
cosub | semisup_cub), multi_label, model (without init only), steps (finetune length; -1:
the recipe's), classifier (mode=linear: ridge | logistic), res (image size; -1: the
checkpoint's, or 32 on the demo / 224 without init).
"""
import ml_collections

from bigpretrain import checkpoint
from bigpretrain import config_lib
from bigpretrain import models
from bigpretrain.evaluators import linear_probe
from configs import common_fewshot
from configs import cosub_finetune_in1k
from configs import swag_finetune
from input_pipeline.sources import demo as demo_lib
from input_pipeline.sources import demo_coarse
from input_pipeline.sources import hashtag_source
from input_pipeline import datasets
from input_pipeline import pipeline

MODES = ("finetune", "linear", "fewshot")
RECIPES = ("in21k", "swag", "cosub", "semisup_cub")
HEAD = "^params/head/"
COSUB_MODEL_KEYS = ("drop_path_rate", "drop_path_schedule", "stochastic_depth")
# in21k recipe (Alibaba-MIIL/ImageNet21K Transfer_learning.md).
IN21K = dict(lr=2e-4, batch=128, epochs=50.0, warmup_epochs=3.0, min_lr=1e-8,
             weight_decay=1e-4, label_smoothing=0.1, ema=0.995)
# Paper 002 supplement Table 13 (CUB-2011 full fine-tuning).
SEMISUP_CUB = dict(lr=0.0025, lr_batch=256, batch=768, epochs=300.0, decay_every=100.0,
                   weight_decay=0.001, decay_factor=0.1)
# Paper 002: 768 images on 32 GPUs (supplement section 6), BatchNorm on each GPU (section 4.1).
SEMISUP_CUB_BN_GROUP = 24
# A bigpretrain checkpoint's position-embedding resize per recipe (models.vit.RESIZE_METHODS):
# the in21k recipe is a timm run (timm's resample_abs_pos_embed); SWAG's trainer is
# ClassyVision (swag_finetune.CLASSY_RESIZE); cosub's code base is DeiT's (its fine-tuning
# interpolates with align_corners=False). A converted checkpoint's follows its library (auto).
RECIPE_RESIZE = {"in21k": "bicubic_antialias", "swag": swag_finetune.CLASSY_RESIZE,
                 "cosub": "bicubic", "semisup_cub": "bicubic"}
DEMO_BATCH, DEMO_STEPS, DEMO_LR = 64, 300, 1e-3
HASHTAG_DEMO = hashtag_source.PREFIX + hashtag_source.DEMO_NAME  # Multi-label demo (id lists).


def is_demo(dataset: str) -> bool:
  return (demo_lib.is_demo_name(dataset) or dataset in ("demo_coarse", "demo_plain_coarse")
          or dataset == HASHTAG_DEMO)


def _has_label(dataset: str) -> bool:
  return demo_lib.is_demo_name(dataset) or dataset in ("demo_coarse", "demo_plain_coarse")


def multi_label_field(dataset: str, data_dir: str) -> str:
  """objective.field of multi_label on `dataset`: '' (label + ancestors) when it has a single
  'label'; else its id-list field: 'labels' (datasets.LABEL_LIST, tfds voc) if it has one,
  else its only id-list field (a hashtag dataset's 'hashtag_ids'). Reads the dataset's info."""
  if _has_label(dataset):
    return ""
  features = datasets.get_dataset({"name": dataset, "dir": data_dir}).info.features
  if "label" in features:
    return ""
  lists = sorted(k for k, size in features.items() if size)
  if datasets.LABEL_LIST in lists:
    return datasets.LABEL_LIST
  if len(lists) == 1:
    return lists[0]
  raise ValueError(f"multi_label on dataset {dataset!r}: it has no 'label' and no single "
                   f"id-list field to read the labels from (id lists: {lists}); set "
                   "--config.objective.field.")


def _set_length(config, demo: bool, batch_size: int, epochs: float, lr: float,
                lr_batch: int, every: tuple[int, int]) -> None:
  """Batch, length, lr and cadence: the demo's short run, or the recipe's at paper scale
  (lr linear in the batch, lr at lr_batch; logs every[0] steps, evals and saves every[1])."""
  if demo:
    config.batch_size, config.total_steps = DEMO_BATCH, DEMO_STEPS
    config.optim.lr = DEMO_LR
    config.log_every_steps, config.eval_every_steps = 25, 100
    config.ckpt_every_steps = DEMO_STEPS
    return
  config.batch_size = batch_size
  config.num_epochs = epochs
  config.optim.lr = lr * config.get_ref("batch_size").to_float() / float(lr_batch)
  config.data.num_workers = 8
  config.compute_dtype = "bfloat16"
  config.log_every_steps = every[0]
  config.eval_every_steps = config.ckpt_every_steps = every[1]


def _in21k(demo: bool) -> ml_collections.ConfigDict:
  config = config_lib.base_config()
  config.data = pipeline.data_defaults()
  config.objective = dict(name="softmax", label_smoothing=IN21K["label_smoothing"])
  config.optim.name = "adam"  # Coupled L2 weight decay, as torch's Adam.
  config.optim.weight_decay = IN21K["weight_decay"]
  config.optim.schedule.name = "cosine"
  config.ema.momentum = IN21K["ema"]
  config.data.train_augment = "flip" if demo else "squish|flip|randaugment(2, 9)|cutout"
  config.data.eval_resize = "squish"
  # Linear in the batch, at the reference 128.
  _set_length(config, demo, IN21K["batch"], IN21K["epochs"], IN21K["lr"], IN21K["batch"],
              every=(100, 2000))
  config.optim.schedule.warmup_frac = IN21K["warmup_epochs"] / IN21K["epochs"]
  config.optim.schedule.end_factor = IN21K["min_lr"] / IN21K["lr"]
  return config


def _semisup_cub(demo: bool) -> ml_collections.ConfigDict:
  """Table 13's full fine-tuning (module docstring)."""
  r = SEMISUP_CUB
  config = config_lib.base_config()
  config.data = pipeline.data_defaults()
  config.objective = dict(name="softmax", label_smoothing=0.0)
  config.optim.name = "sgd"
  config.optim.momentum = 0.9
  config.optim.nesterov = False
  config.optim.weight_decay = r["weight_decay"]
  config.optim.schedule.name = "step"
  config.optim.schedule.warmup_steps = 0
  config.optim.schedule.decay_factor = r["decay_factor"]
  config.optim.schedule.num_decays = round(r["epochs"] / r["decay_every"]) - 1
  config.data.train_augment = "inception_crop|flip"
  config.data.eval_resize = "center_crop"
  config.data.normalize = "imagenet"
  # Linear in the batch: 0.0025 / 256 x batch.
  _set_length(config, demo, r["batch"], r["epochs"], r["lr"], r["lr_batch"], every=(50, 1000))
  return config


def _finetune(arg, demo: bool) -> ml_collections.ConfigDict:
  base_dataset = "demo" if demo else arg.dataset
  if arg.recipe == "in21k":
    config = _in21k(demo)
  elif arg.recipe == "semisup_cub":
    config = _semisup_cub(demo)
  elif arg.recipe == "swag":  # Table 8's lr and the ViT epochs depend on the model.
    model = checkpoint.read_meta(arg.init)["model"]["name"] if arg.init else arg.model
    config = swag_finetune.get_config(f"dataset={base_dataset},data_dir={arg.data_dir},"
                                      f"model={model}")
  else:
    # The checkpoint is set below; without one, transfer trains from scratch.
    config = cosub_finetune_in1k.get_config(f"dataset={base_dataset},data_dir={arg.data_dir},"
                                            "init=none")
  config.data.name, config.data.dir = arg.dataset, arg.data_dir
  if arg.steps > 0:
    config.total_steps, config.num_epochs = arg.steps, -1.0
  if arg.multi_label:
    if arg.recipe == "cosub":
      raise ValueError("multi_label with recipe=cosub: cosub trains submodels with its own "
                       "loss; use recipe=in21k (ASL, as the paper's multi-label transfers).")
    config.objective = dict(name="multi_label", loss="asl", gamma_neg=4.0, gamma_pos=0.0,
                            clip=0.05, map_bins=1000, loss_scale=1.0,
                            field=multi_label_field(arg.dataset, arg.data_dir))
    config.mixup = config_lib.base_config().mixup  # Mixing multi-hot targets: not the recipe.
    config.evals.eval.topk = (1,)
  return config


def _frozen(arg, mode: str) -> ml_collections.ConfigDict:
  """An evaluation-only run (total_steps=0) whose one evaluator is the transfer probe."""
  if arg.multi_label:
    raise ValueError(f"multi_label applies to mode=finetune, not mode={mode}.")
  config = _in21k(is_demo(arg.dataset))
  config.data.name, config.data.dir = arg.dataset, arg.data_dir
  config.total_steps = 0
  config.ema.momentum = 0.0
  if mode == "linear":
    probe = dict(type="linear", classifier=arg.classifier)
  else:
    label = arg.dataset.replace(":", "_").replace("/", "_")
    l2 = common_fewshot.DEMO_L2_REG if is_demo(arg.dataset) else linear_probe.L2_REG
    probe = dict(type="fewshot", shots=(1, 5, 10, 25), seeds=3, l2_reg=l2,
                 datasets={label: (arg.dataset, config.data.train_split,
                                   config.data.eval_split)})
  config.evals = ml_collections.ConfigDict({mode: probe})
  return config


def get_config(arg=None):
  """Transfer config; `arg` e.g. 'mode=fewshot,init=/runs/ss_demo,dataset=demo_coarse'."""
  arg = config_lib.parse_arg(arg, mode="", init="", dataset="demo_coarse", data_dir="",
                             recipe="in21k", multi_label=False, model="", steps=-1,
                             classifier="ridge", res=-1)
  if arg.mode not in MODES:
    raise ValueError(f"config arg mode={arg.mode!r} must be one of {MODES}.")
  if arg.recipe not in RECIPES:
    raise ValueError(f"config arg recipe={arg.recipe!r} must be one of {RECIPES}.")
  if arg.classifier not in linear_probe.CLASSIFIERS:
    raise ValueError(f"config arg classifier={arg.classifier!r} must be one of "
                     f"{linear_probe.CLASSIFIERS.names()}.")
  if arg.init and arg.model:
    raise ValueError(f"model={arg.model!r} and init={arg.init!r}: the checkpoint sets the "
                     "model; leave model out.")
  if not arg.init and not (arg.mode == "finetune" and arg.model):
    raise ValueError(f"mode={arg.mode} needs init=CHECKPOINT (a run's workdir or a converted "
                     "checkpoint); only mode=finetune with model=NAME runs from scratch.")
  demo = is_demo(arg.dataset)
  config = _finetune(arg, demo) if arg.mode == "finetune" else _frozen(arg, arg.mode)
  recipe_model = dict(config.model) if "model" in config else {}
  if arg.init:
    meta = checkpoint.read_meta(arg.init)
    config.model = config_lib.finetune_model_section(meta["model"])
    config.data.image_size = meta["data"]["image_size"]
    config.data.normalize = meta["data"]["normalize"]
    if not meta.get("source"):
      config.model_init_resize = RECIPE_RESIZE[arg.recipe]
  else:
    config.model = config_lib.model_section(name=arg.model)
    config.data.image_size = 32 if demo else 224
  if arg.res > 0:
    config.data.image_size = arg.res
  if (arg.mode == "finetune" and arg.recipe == "semisup_cub" and not demo
      and models.accepts(config.model.name, "bn_group_size")):
    config.model.bn_group_size = SEMISUP_CUB_BN_GROUP
  if arg.recipe == "swag" and arg.mode == "finetune" and config.model.get("pre_logits"):
    config.model.pre_logits = False  # As configs/swag_finetune.py (SWAG Table 5).
  if arg.recipe == "cosub" and arg.mode == "finetune":
    # The checkpoint's architecture with cosub's training-time stochastic depth (ESD).
    for key in COSUB_MODEL_KEYS:
      config.model[key] = recipe_model[key]
  config.model_init = arg.init
  config.model_init_skip = HEAD if arg.init else ""
  if arg.mode == "finetune":  # On the demo's datasets: probes the demo they come from.
    # hashtags:demo has no single labels to probe: the demo it is made from.
    probe = "demo" if arg.dataset == HASHTAG_DEMO else demo_coarse.FINE.get(arg.dataset,
                                                                             arg.dataset)
    common_fewshot.add(config, demo, dataset=probe if demo else "demo")
  return config
