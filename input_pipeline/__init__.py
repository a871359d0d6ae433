"""Input pipelines: datasets (tfds builders on ArrayRecord), grain pipelines, augmentations."""
from bigpretrain import moved  # pylint: disable=g-bad-import-order

moved.install()
