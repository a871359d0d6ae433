r"""Transfer a pretrained checkpoint to a dataset: fine-tune, linear probe or few-shot.

  python -m bigpretrain.main --config=configs/transfer.py:mode=MODE,init=DIR[,dataset=NAME,...]

`init` is any bigpretrain checkpoint (a run's workdir, its checkpoints/ folder or a
`bigpretrain.tools.convert` output); the model, its image size and its input normalisation come
from the checkpoint's meta; the class count comes from the dataset, and the classifier head
always starts fresh (model_init_skip='^params/head/'). `dataset` is any prepared dataset
name (tfds:NAME, folder:NAME, imagenet21k_p, demo, ...); the default, `demo_coarse`, is the
demo's second task: demo images labelled one WordNet level up (12 classes,
input_pipeline/demo_coarse.py).

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
    Multi-label datasets (MS-COCO, Pascal-VOC) train with ASL, as the paper's multi-label
    transfers do (`multi_label`).
  - swag: configs/swag_finetune.py's values (Singh et al. 2022, section 4.1: SGD, no weight
    decay, mixup 0.1, EMA on large sets, shorter-side centre-crop eval).
  - cosub: configs/cosub_finetune_in1k.py's values (Touvron et al. 2023, supplement A.1:
    LAMB, LayerDecay, cosub on); ViT models only.
- linear: a linear classifier on frozen pooled features (model.features(), eval mode), in
  closed form: ridge regression on the whole train split (bigpretrain/linear_probe.py). Chosen
  over SGD on a frozen backbone because it is exact and has no lr/epoch grid, and because
  the eval-mode features keep BatchNorm statistics frozen, which the trainer's train-mode
  forward would update. No training step runs (total_steps=0); the row 'linear/top1' is
  written to metrics.jsonl.
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

Args: mode (finetune | linear | fewshot), init (checkpoint; required but for
finetune with model=, the from-scratch baseline), dataset, data_dir, recipe (in21k | swag |
cosub), multi_label, model (without init only), steps (finetune length; -1: the recipe's).
"""
import ml_collections

from bigpretrain import checkpoint
from bigpretrain import config_lib
from bigpretrain import linear_probe
from configs import common_fewshot
from configs import cosub_finetune_in1k
from configs import swag_finetune
from input_pipeline import demo as demo_lib
from input_pipeline import demo_coarse
from input_pipeline import pipeline

MODES = ("finetune", "linear", "fewshot")
RECIPES = ("in21k", "swag", "cosub")
HEAD = "^params/head/"
COSUB_MODEL_KEYS = ("drop_path_rate", "drop_path_schedule", "stochastic_depth")
# in21k recipe (Alibaba-MIIL/ImageNet21K Transfer_learning.md).
IN21K = dict(lr=2e-4, batch=128, epochs=50.0, warmup_epochs=3.0, min_lr=1e-8,
             weight_decay=1e-4, label_smoothing=0.1, ema=0.995)
DEMO_BATCH, DEMO_STEPS, DEMO_LR = 64, 300, 1e-3


def is_demo(dataset: str) -> bool:
  return demo_lib.is_demo_name(dataset) or dataset in ("demo_coarse", "demo_plain_coarse")


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
  if demo:
    config.batch_size, config.total_steps = DEMO_BATCH, DEMO_STEPS
    config.optim.lr = DEMO_LR
    config.log_every_steps, config.eval_every_steps = 25, 100
    config.ckpt_every_steps = DEMO_STEPS
  else:
    config.batch_size = IN21K["batch"]
    config.num_epochs = IN21K["epochs"]
    batch = config.get_ref("batch_size")  # Linear in the batch, at the reference 128.
    config.optim.lr = IN21K["lr"] * batch.to_float() / float(IN21K["batch"])
    config.data.num_workers = 8
    config.compute_dtype = "bfloat16"
    config.log_every_steps, config.eval_every_steps, config.ckpt_every_steps = 100, 2000, 2000
  config.optim.schedule.warmup_frac = IN21K["warmup_epochs"] / IN21K["epochs"]
  config.optim.schedule.end_factor = IN21K["min_lr"] / IN21K["lr"]
  return config


def _finetune(arg, demo: bool) -> ml_collections.ConfigDict:
  base_dataset = "demo" if demo else arg.dataset
  if arg.recipe == "in21k":
    config = _in21k(demo)
  elif arg.recipe == "swag":
    config = swag_finetune.get_config(f"dataset={base_dataset},data_dir={arg.data_dir}")
  else:
    config = cosub_finetune_in1k.get_config(f"dataset={base_dataset},data_dir={arg.data_dir}")
  config.data.name, config.data.dir = arg.dataset, arg.data_dir
  if arg.steps > 0:
    config.total_steps = arg.steps
  if arg.multi_label:
    if arg.recipe == "cosub":
      raise ValueError("multi_label with recipe=cosub: cosub trains submodels with its own "
                       "loss; use recipe=in21k (ASL, as the paper's multi-label transfers).")
    config.objective = dict(name="multi_label", loss="asl", gamma_neg=4.0, gamma_pos=0.0,
                            clip=0.05, map_bins=1000, loss_scale=1.0)
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
    probe = dict(type="linear")
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
                             recipe="in21k", multi_label=False, model="", steps=-1)
  if arg.mode not in MODES:
    raise ValueError(f"config arg mode={arg.mode!r} must be one of {MODES}.")
  if arg.recipe not in RECIPES:
    raise ValueError(f"config arg recipe={arg.recipe!r} must be one of {RECIPES}.")
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
    config.model = dict(meta["model"])
    config.data.image_size = meta["data"]["image_size"]
    config.data.normalize = meta["data"]["normalize"]
  else:
    config.model = dict(name=arg.model)
    config.data.image_size = 32 if demo else 224
  if arg.recipe == "cosub" and arg.mode == "finetune":
    # The checkpoint's architecture with cosub's training-time stochastic depth (ESD).
    for key in COSUB_MODEL_KEYS:
      config.model[key] = recipe_model[key]
  config.model_init = arg.init
  config.model_init_skip = HEAD if arg.init else ""
  if arg.mode == "finetune":  # On the demo's datasets: probes the demo they come from.
    common_fewshot.add(config, demo, dataset=demo_coarse.FINE.get(arg.dataset, arg.dataset)
                       if demo else "demo")
  return config
