r"""Semantic knowledge distillation on ImageNet-21K (Ridnik et al. 2021, section 3.4): semantic
softmax plus a per-level MSE between teacher and student level-softmaxes, weighted by the
teacher's confidence (sum of its top ceil(n_k / 20) probabilities at level k); total =
semantic loss + kd_weight * KD (kd_weight 1). The teacher is frozen and runs in the same step.

Demo (two commands: a semantic-softmax teacher, then a student distilled from it):
  python -m bigpretrain.main --config=configs/semantic_softmax.py --workdir=/tmp/teacher
  python -m bigpretrain.main --config=configs/semantic_kd.py:teacher=/tmp/teacher --workdir=/tmp/kd

Paper scale (8x V100 as configs/semantic_softmax.py; the paper's teacher is a TResNet-L
trained with semantic softmax on ImageNet-21K-P):
  python -m bigpretrain.main --config=configs/semantic_kd.py:dataset=imagenet21k_p,data_dir=/data/tfds,model=vit_b16,teacher=/runs/teacher \
    --workdir=/runs/kd_vit_b16
Paper number: TResNet-M fine-tunes to 82.2% on ImageNet-1K after semantic softmax + KD
pretraining, vs 81.4% without KD (Table 2).

Args: those of configs/semantic_softmax.py, plus teacher (a run's workdir or checkpoints/
folder; its checkpoint names the teacher's model, which may differ from the student's).
"""
from bigpretrain import config_lib
from configs import semantic_softmax


def get_config(arg=None):
  arg = config_lib.parse_arg(arg, dataset="demo", data_dir="", model="", epochs=80.0,
                             teacher="")
  base_arg = f"dataset={arg.dataset},data_dir={arg.data_dir},model={arg.model},epochs={arg.epochs}"
  config = semantic_softmax.get_config(base_arg)
  config.objective = dict(
      name="semantic_kd", label_smoothing=0.2, max_weight=20.0, kd_weight=1.0,
      teacher_checkpoint=arg.teacher)
  return config
