"""The paper's per-level view of one prediction (ImageNet-21K paper, Figure 1): at each
hierarchy level, the top class and its probability, with WordNet names."""
import numpy as np

from bigpretrain.semantic import wordnet


def synset_name(wnid: str) -> str:
  """The first WordNet lemma of `wnid`, spaces for underscores ('hunting dog')."""
  return wordnet.synset_from_wnid(wnid).lemma_names()[0].replace("_", " ")


def semantic_view(logits: np.ndarray, tree, sigmoid: bool, threshold: float) -> list[dict]:
  """Per level: the top class and its probability, kept where it exceeds `threshold`; a
  per-level softmax (semantic objectives) or the per-class sigmoid (`sigmoid`,
  multi-label). A level of one class is left out under a softmax (its probability is always
  1: ImageNet-21K-P's 12th level), as the semantic accuracy leaves it out (metrics.py)."""
  out = []
  for level, classes in enumerate(tree.level_classes):
    if len(classes) == 1 and not sigmoid:
      continue
    level_logits = logits[classes]
    if sigmoid:
      probs = 1 / (1 + np.exp(-level_logits))
    else:
      probs = np.exp(level_logits - level_logits.max())
      probs /= probs.sum()
    best = int(np.argmax(probs))
    if probs[best] > threshold:
      wnid = tree.wnids[classes[best]]
      out.append({"level": level, "class": int(classes[best]), "wnid": wnid,
                  "name": synset_name(wnid), "prob": float(probs[best])})
  return out
