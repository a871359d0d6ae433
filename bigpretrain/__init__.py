"""bigpretrain: large-scale image pretraining recipes on one sharded JAX trainer."""
from bigpretrain import moved

moved.install()
