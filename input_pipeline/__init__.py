"""Input pipelines: datasets (tfds builders on ArrayRecord), grain pipelines, augmentations."""
