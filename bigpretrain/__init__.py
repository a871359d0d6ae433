"""bigpretrain: large-scale image pretraining recipes on one sharded JAX trainer."""
import flax

# Parameters are created abstractly and placed by bigpretrain.sharding from logical
# axis names; Flax's eager variable sharding would require a mesh at construction.
flax.config.update("flax_always_shard_variable", False)
