"""Semantic knowledge distillation (ImageNet-21K Pretraining for the Masses, section 3.4).

Semantic softmax on the labels plus, per hierarchy level, an MSE between teacher and student
level-softmaxes weighted by the teacher's confidence at that level. The teacher is any
registered model loaded frozen from a bigpretrain checkpoint, sharded like the student and run
inside the same jitted step.
"""
import jax

from bigpretrain import checkpoint
from bigpretrain import losses
from bigpretrain import models
from bigpretrain import sharding
from bigpretrain.objectives import base
from bigpretrain.objectives import semantic_softmax


class SemanticKD(semantic_softmax.SemanticSoftmax):
  """Loss: semantic softmax + kd_weight * sum_k sum_b P_bk ||p^s_bk - p^t_bk||^2 / B."""

  KEYS = {"label_smoothing", "max_weight", "kd_weight", "teacher_model", "teacher_checkpoint"}

  def __init__(self, cfg, info, topk=(1, 5)):
    super().__init__(cfg, info, topk, allowed=self.KEYS)
    self.kd_weight = float(cfg.get("kd_weight", 1.0))
    if "teacher_model" not in cfg or "name" not in cfg.teacher_model:
      raise ValueError("config.objective.teacher_model.name must name the teacher's model.")
    self.teacher_cfg = dict(cfg.teacher_model)
    self.teacher_dir = cfg.get("teacher_checkpoint", "")
    if not self.teacher_dir:
      raise ValueError("config.objective.teacher_checkpoint is empty: semantic_kd needs a "
                       "teacher checkpoint (a bigpretrain workdir or its checkpoints/ folder).")
    self.num_classes = info.num_classes
    self.teacher_def = None

  def load_frozen(self, mesh, rules, compute_dtype):
    """Loads the teacher's params and state, sharded by the student's logical rules."""
    self.teacher_def = models.ModelDef.from_config(self.teacher_cfg, self.num_classes,
                                                   compute_dtype)
    shardings = {
        "params": sharding.state_shardings(self.teacher_def.abstract_params, rules, mesh),
        "extra": sharding.state_shardings(self.teacher_def.abstract_extra, (), mesh),
    }
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        {"params": self.teacher_def.abstract_pure_params(),
         "extra": self.teacher_def.abstract_pure_extra()},
        shardings)
    return checkpoint.load_params(self.teacher_dir, abstract), shardings

  def loss(self, model, batch, rng, frozen=None):
    logits = model(batch["image"], train=True, rng=rng)
    teacher = self.teacher_def.merge(frozen["params"], frozen["extra"])
    teacher_logits = jax.lax.stop_gradient(teacher(batch["image"], train=False))
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
