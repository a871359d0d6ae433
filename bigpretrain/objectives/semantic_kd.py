"""Semantic knowledge distillation (ImageNet-21K Pretraining for the Masses, section 3.4).

Semantic softmax on the labels plus, per hierarchy level, an MSE between teacher and student
level-softmaxes weighted by the teacher's confidence at that level (eq. 3-4). The teacher is
whatever model its checkpoint describes, loaded frozen, sharded like the student and run
inside the same jitted step.

The authors' released code (Alibaba-MIIL/ImageNet21K) has no semantic KD, so these are this
project's own choices, not the paper's:
- teacher confidence P_k: the sum of the teacher's top ceil(n_k / 20) probabilities at level
  k (the paper defers P_k to its appendix F, "similar to" Xie et al.'s noisy student);
- the MSE is summed over a level's n_k classes and averaged over the batch;
- kd_weight 1: the semantic loss and the KD loss added with equal weight.

Student and teacher share one class tree (the KD compares their level softmaxes level by
level): the tree the teacher's checkpoint stores when it has one (its level heads were trained
for it, under whatever rule built it then), else the tree built now.
"""
import math

import jax

from bigpretrain import checkpoint
from bigpretrain import losses
from bigpretrain import models
from bigpretrain.models import pretrained
from bigpretrain.objectives import base
from bigpretrain.objectives import semantic_softmax
from bigpretrain.runtime import console
from bigpretrain.semantic import tree as tree_lib


@base.OBJECTIVES.register("semantic_kd")
class SemanticKD(semantic_softmax.SemanticSoftmax):
  """Loss: semantic softmax + kd_weight * sum_k sum_b P_bk ||p^s_bk - p^t_bk||^2 / B."""

  KEYS = {"label_smoothing", "max_weight", "kd_weight", "teacher_checkpoint"}

  def __init__(self, cfg, info):
    super().__init__(cfg, info, allowed=self.KEYS)
    self.kd_weight = float(cfg.get("kd_weight", 1.0))
    if not (math.isfinite(self.kd_weight) and self.kd_weight >= 0):
      raise ValueError(f"config.objective.kd_weight={self.kd_weight} must be finite and >= 0.")
    self.teacher_dir = cfg.get("teacher_checkpoint", "")
    if not self.teacher_dir:
      raise ValueError("config.objective.teacher_checkpoint is empty: semantic_kd needs a "
                       "teacher checkpoint (a bigpretrain workdir or its checkpoints/ folder).")
    self.class_names = list(info.class_names)
    self.teacher_def = None
    self.teacher_tree = None  # The tree the teacher's checkpoint stores, once read.

  def load_frozen(self, mesh, rules, compute_dtype, data_cfg):
    """The teacher's params and state, sharded by the student's logical rules. The teacher
    sees the student's batch, so it must expect the same normalisation."""
    self._check_teacher(checkpoint.read_meta(self.teacher_dir), data_cfg)
    teacher = pretrained.load(self.teacher_dir, mesh=mesh, rules=rules,
                              compute_dtype=compute_dtype)
    self.teacher_def = teacher.model_def
    return teacher.variables, teacher.shardings

  def abstract_frozen(self, mesh, rules, compute_dtype, data_cfg, model=None):
    """The teacher's shapes and shardings: from its checkpoint's meta, or `model` in its
    place (a teacher of this dataset's classes)."""
    if model is None:
      meta = checkpoint.read_meta(self.teacher_dir)
      self._check_teacher(meta, data_cfg)
      model = meta["model"]
    self.teacher_def = models.ModelDef.from_config(model, len(self.class_names), compute_dtype,
                                                   data_cfg.image_size)
    return pretrained.abstract_variables(self.teacher_def, mesh, rules)

  def _check_teacher(self, meta, data_cfg) -> None:
    """Refuses a teacher of other classes or inputs; takes the tree the teacher stores."""
    if meta["class_names"] != self.class_names:
      raise ValueError(
          f"The teacher in {self.teacher_dir} was trained on {meta['num_classes']} "
          f"classes of {meta['dataset']!r}, not on this dataset's "
          f"{len(self.class_names)} classes: semantic KD needs the same class list.")
    expects = meta["data"]["normalize"]
    if expects != data_cfg.normalize:
      raise ValueError(
          f"The teacher in {self.teacher_dir} was trained on images normalised by {expects!r}, "
          f"but config.data.normalize={data_cfg.normalize!r}: the teacher would see inputs "
          f"it was not trained on. Set --config.data.normalize={expects}.")
    size = meta["data"]["image_size"]
    if size != data_cfg.image_size:  # It sees the student's batch.
      raise ValueError(
          f"The teacher in {self.teacher_dir} was trained at {size} px, but "
          f"config.data.image_size={data_cfg.image_size}: the teacher sees the student's "
          f"images (a ViT's grid is fixed, a convnet's accuracy falls at another size). Set "
          f"--config.data.image_size={size}, or distil from a teacher trained at this size.")
    self.teacher_tree = base.stored_tree(meta, self.tree)
    change = ("" if self.teacher_tree is None
              else tree_lib.describe_change(self.teacher_tree, self.tree))
    if change:
      console.warn(f"the teacher in {self.teacher_dir} was trained on another class tree than "
                   f"the one built now (teacher's -> now: {change}); the student trains on "
                   "the teacher's, so that the teacher's levels keep their meaning.")
    if self.teacher_tree is not None:
      self.tree = self.teacher_tree

  def restore_meta(self, saved: dict) -> str:
    """As the base class; a student checkpoint whose tree is not the teacher's is refused:
    their level softmaxes could not be compared level by level."""
    change = super().restore_meta(saved)
    if self.teacher_tree is not None and self.tree != self.teacher_tree:
      raise checkpoint.CheckpointMismatch(
          f"the student's weights were trained on another class tree than the teacher in "
          f"{self.teacher_dir} stores (student's -> teacher's: "
          f"{tree_lib.describe_change(self.tree, self.teacher_tree)}): semantic KD compares "
          "their levels class group by class group. Resume with the teacher it was distilled "
          "from, start a new run (--workdir), or, initialising from such weights "
          "(model_init), start the head fresh (--config.model_init_skip='^params/head/').")
    return change

  def teacher_logits(self, frozen, images):
    teacher = self.teacher_def.merge(frozen["params"], frozen["extra"])
    return jax.lax.stop_gradient(teacher(images, train=False))

  def loss(self, model, batch, rng, frozen=None):
    logits = model(batch["image"], train=True, rng=rng)
    teacher_logits = self.teacher_logits(frozen, batch["image"])
    targets = self.targets[batch["label"]]
    sem, sem_aux = losses.semantic_softmax_loss(logits, targets, self.tree,
                                                label_smoothing=self.label_smoothing,
                                                max_weight=self.max_weight)
    kd, kd_aux = losses.semantic_kd_loss(logits, teacher_logits, self.tree)
    aux = {"train/semantic_loss": sem, "train/kd_loss": kd}
    for k in range(self.tree.num_levels):
      aux[f"train/level{k}_loss"] = sem_aux["level_losses"][k]
      aux[f"train/level{k}_kd_loss"] = kd_aux["level_losses"][k]
    return sem + self.kd_weight * kd, aux
