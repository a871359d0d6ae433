r"""Semantic knowledge distillation on ImageNet-21K (Ridnik et al. 2021, section 3.4): semantic
softmax plus a per-level MSE between teacher and student level-softmaxes, weighted by the
teacher's confidence P_k (eq. 4); total = semantic loss + kd_weight * KD. The teacher is
frozen and runs in the same step. The authors' released code (Alibaba-MIIL/ImageNet21K) has
no KD, and appendix F is not reproduced here, so three details are this project's choices:
P_k = the sum of the teacher's top ceil(n_k / 20) probabilities at level k, the MSE summed
over a level's classes, and kd_weight 1 (see bigpretrain/objectives/semantic_kd.py).

Demo (two commands: a semantic-softmax teacher, then a student distilled from it; the teacher
trains three times the student's demo length so that it is stronger than the student, as the
paper's larger teacher is; train it once and reuse it for every student):
  python -m bigpretrain.main --config=configs/semantic_softmax.py --config.total_steps=600 \
    --workdir=/tmp/teacher
  python -m bigpretrain.main --config=configs/semantic_kd.py:teacher=/tmp/teacher --workdir=/tmp/kd

Paper scale (8x V100 as configs/semantic_softmax.py; the paper's teacher is a TResNet-L
trained with semantic softmax on ImageNet-21K-P):
  python -m bigpretrain.main --config=configs/semantic_kd.py:dataset=imagenet21k_p,data_dir=/data/tfds,model=vit_b16,teacher=/runs/teacher \
    --workdir=/runs/kd_vit_b16
Paper number: none for ViT-B/16, the default. Table 2 reports KD for one student: 82.2% on
ImageNet-1K after semantic softmax + KD pretraining, vs 81.4% without KD. Table 2 does not
name its model; its KD column equals Table 4's TResNet-M ImageNet-21K-P column on five of the
six datasets both list (Kinetics-200: 84.4 vs 84.3), so it is read here as TResNet-M
(`:model=tresnet_m`).

Args: those of configs/semantic_softmax.py, plus teacher (a run's workdir or checkpoints/
folder; its checkpoint names the teacher's model, which may differ from the student's).
"""
from bigpretrain.semantic import tree as tree_lib
from configs import semantic_softmax


def get_config(arg=None):
  arg = semantic_softmax.parse(arg, teacher="")
  config = semantic_softmax.get_config(semantic_softmax.base_arg(arg))
  config.objective = dict(
      name="semantic_kd", label_smoothing=0.2, max_weight=tree_lib.MAX_LEVEL_WEIGHT, kd_weight=1.0,
      teacher_checkpoint=arg.teacher)
  return config
