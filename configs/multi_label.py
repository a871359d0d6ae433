r"""ImageNet-21K multi-label baseline (Ridnik et al. 2021, section 3.2): each image's label
plus all its WordNet ancestors are positives, one sigmoid per class, asymmetric loss (ASL,
gamma_neg=4, gamma_pos=0, clip=0.05, as in the ASL paper the authors adopt; appendix B.2);
`loss=bce` gives plain sigmoid BCE. Evaluated by mAP over classes (plus semantic top-1).
Otherwise the recipe of configs/semantic_softmax.py.

Demo:        python -m bigpretrain.main --config=configs/multi_label.py --workdir=/tmp/ml_demo
Paper scale: python -m bigpretrain.main \
               --config=configs/multi_label.py:dataset=imagenet21k_p,data_dir=/data/tfds,model=vit_b16
Paper number: none for ViT-B/16, the default. Table 2 reports the baselines for one model:
multi-label pretraining fine-tunes to 81.0% on ImageNet-1K, vs 81.1% single-label and 81.4%
semantic softmax. Table 2 does not name its model; its KD column equals Table 4's TResNet-M
ImageNet-21K-P column on five of the six datasets both list (Kinetics-200: 84.4 vs 84.3), so
it is read here as TResNet-M (`:model=tresnet_m`). Hardware, schedule and augmentation as
configs/semantic_softmax.py.

ASL's scale: the reference AsymmetricLoss (Alibaba-MIIL/ASL src/loss_functions/losses.py)
returns -loss.sum() over its batch; summed over each GPU's 64 images, with DDP averaging the 8
GPUs' gradients, that is 64 x our batch mean, so the paper-scale ASL run sets loss_scale=64.
Under Adam with coupled L2, scaling the loss by s acts like weight decay / s: the batch mean
alone would decay 64 times harder than the reference. The demo keeps loss_scale 1.

Args: those of configs/semantic_softmax.py, plus loss (asl | bce).
"""
from configs import semantic_softmax
from input_pipeline.sources import demo

# Images per GPU in the authors' runs (64 on each of 8 GPUs, configs/semantic_softmax.py).
ASL_PER_DEVICE_BATCH = 64.0


def get_config(arg=None):
  arg = semantic_softmax.parse(arg, loss="asl")
  config = semantic_softmax.get_config(semantic_softmax.base_arg(arg))
  config.objective = dict(name="multi_label", loss=arg.loss, gamma_neg=4.0, gamma_pos=0.0,
                          clip=0.05, map_bins=1000, loss_scale=1.0)
  if not demo.is_demo_name(arg.dataset) and arg.loss == "asl":
    config.objective.loss_scale = ASL_PER_DEVICE_BATCH
  return config
