"""Top-K selection rules of the semi-supervised recipe (Yalniz et al., 2019, section 3.2).

topk.py: the ranked rules (balanced: K per class; unbalanced: per-class K, e.g. Zipf) on arrays
in memory, and the numpy core the Beam job input_pipeline/selection_job.py combines at scale.
tags.py: balanced-with-tags (K random images per class among those whose tags name it).
"""
