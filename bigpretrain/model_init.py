"""Model-init hooks: what `config.model_init_head` names, run once after config.model_init has
loaded a checkpoint's weights into a fresh run (never on resume).

A hook is `hook(init_dir, params, class_names) -> params` (params as pure dicts, class_names
the run's dataset classes), registered where it is defined. A recipe's hooks live with the
recipe, imported on first use.
"""
from bigpretrain import registry

HOOKS = registry.Registry("model-init hook", "config.model_init_head")
# SWAG: the classifier initialised from a hashtag model's head through the WordNet class map.
HOOKS.register_lazy("zero_shot", "bigpretrain.swag.head_init")
