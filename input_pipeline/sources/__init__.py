"""The built-in data sources: each module registers its loaders in datasets.SOURCES on
import, as a user's source does in a module listed in config.plugins.

demo.py              'demo', 'demo_plain' (the embedded synthetic dataset)
demo_coarse.py       'demo_coarse', 'demo_plain_coarse' (the demo's downstream task)
hashtag_source.py    'hashtags:NAME' (SWAG datasets, head/tail resampled)
hashtag_demo.py      'hashtags:demo' (the demo's tags, prepared on first use)
selection_source.py  'selection:DIR' (the semi-supervised recipe's selected dataset)
The prefixes 'tfds:', 'folder:' and 'imagenet21k_p' read prepared files (datasets.py).
"""
# The built-in sources register themselves on import.
from input_pipeline.sources import demo  # pylint: disable=unused-import
from input_pipeline.sources import demo_coarse  # pylint: disable=unused-import
from input_pipeline.sources import hashtag_demo  # pylint: disable=unused-import
from input_pipeline.sources import hashtag_source  # pylint: disable=unused-import
from input_pipeline.sources import selection_source  # pylint: disable=unused-import
