r"""ImageNet-21K multi-label baseline (Ridnik et al. 2021, section 3.2): each image's label
plus all its WordNet ancestors are positives, one sigmoid per class, asymmetric loss (ASL,
gamma_neg=4, gamma_pos=0, clip=0.05, as in the ASL paper the authors adopt; appendix B.2);
`loss=bce` gives plain sigmoid BCE. Evaluated by mAP over classes (plus semantic top-1).
Otherwise the recipe of configs/semantic_softmax.py.

Demo:        python -m bigpretrain.main --config=configs/multi_label.py --workdir=/tmp/ml_demo
Paper scale: python -m bigpretrain.main \
               --config=configs/multi_label.py:dataset=imagenet21k_p,data_dir=/data/tfds,model=vit_b16
Paper number: TResNet-M multi-label pretraining fine-tunes to 81.0% on ImageNet-1K (Table 2),
vs 81.1% single-label and 81.4% semantic softmax. Hardware as configs/semantic_softmax.py.

Args: those of configs/semantic_softmax.py, plus loss (asl | bce).
"""
from bigpretrain import config_lib
from configs import semantic_softmax


def get_config(arg=None):
  arg = config_lib.parse_arg(arg, dataset="demo", data_dir="", model="", epochs=80.0,
                             loss="asl")
  base_arg = f"dataset={arg.dataset},data_dir={arg.data_dir},model={arg.model},epochs={arg.epochs}"
  config = semantic_softmax.get_config(base_arg)
  config.objective = dict(name="multi_label", loss=arg.loss, gamma_neg=4.0, gamma_pos=0.0,
                          clip=0.05, map_bins=1000)
  return config
