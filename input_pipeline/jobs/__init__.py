"""Offline Apache Beam preparation jobs (`python -m input_pipeline.prepare ...`): their
output is what the run-time reader (input_pipeline/) reads; no training process imports them.

beam_images.py     the image job every preparation shares: class sources -> tfds ArrayRecord
imagenet21k_p.py   ImageNet-21K-P (Ridnik et al. 2021, section 2.1)
image_folder.py    any ImageFolder tree
hashtag_job.py     SWAG hashtag datasets; crawl_inputs.py reads their crawled inputs
selection_job.py   the semi-supervised top-K selection of D-hat
dask_runner.py     a Beam runner on a dask.distributed cluster
local_runner.py    the runner when none is named (Beam's FnApiRunner)
"""
