"""Billion-scale semi-supervised learning (Yalniz et al. 2019): the recipe's own library.

semi_supervised.py  the stage runner: teacher -> pool inference -> dedup -> selection ->
                    student -> fine-tuning (`python -m bigpretrain.tools.semi_supervised`)
pool_predictions.py the teacher's top-P classes and scores over the unlabelled pool
dedup.py            the pool deduplicated against the evaluation sets (supplement section 5)
topk.py             the top-K rules (section 3.2) on arrays; the Beam job
                    input_pipeline/jobs/selection_job.py applies them at scale
tags.py             balanced-with-tags selection
"""
