"""The training recipe around the ``mxfp8_ep`` library: a Hydra app (``launch/train.py``,
configs in ``conf/``) that trains torchtitan 0.2.2's MoE models locally or on SLURM.

Installed with the library (``pip install``), so ``launch.*`` imports the same way in the
launching process, in every worker and inside SLURM jobs. The tiny tokenizer and text the
default run trains on are package data (``launch/titan/assets/``).
"""
