"""tests/slurm's fixtures for the 0.3.0 stack's SLURM test (test_recipe_slurm.py): the local
cluster and its `launch/train.py` runner."""

from tests.slurm.conftest import slurm_cluster  # noqa: F401
from tests.slurm.test_train_slurm import train  # noqa: F401
