"""The training recipe around the ``mxfp8_ep`` library: a Hydra app (``launch/train.py``,
configs in ``conf/``) that trains torchtitan 0.2.2's MoE models locally or on SLURM, and
``launch/compare_runs.py``, which compares finished runs.

Installed with the library (``pip install``), so ``launch.*`` imports the same way in the
launching process, in every worker and inside SLURM jobs.

The code lies in subpackages by role, listed lowest first in :data:`LAYERS`: a module imports
from its own subpackage and the ones below it, never from one above (tests/test_import_cycles.py
checks it). ``config``: what a config is; ``run``: a run's folder, records and life; ``titan``:
the torchtitan glue each training process runs; ``launchers``: how the processes start;
``preflight``: from the command line to a launch; ``tools``: reading finished runs. The two
commands sit above them all. A subpackage's ``__init__`` imports nothing, so importing a module
loads only what that module needs (the checks before launch never load torch).
"""

LAYERS = ("config", "run", "titan", "launchers", "preflight", "tools")
