"""How a run's processes start: the launcher interface every launcher implements (``launcher``:
``LauncherConfig``, ``Target``, how a run ended), ``local`` (torch elastic on this machine),
``slurm`` (one submitit job; ``slurm_cluster``: the cluster's partitions and sbatch's refusals),
``machine`` (this machine's GPUs, memory and cores, without torch) and ``worker``, the entry of
every training process, which loads ``launch.titan.runner`` by name. It imports ``launch.config``
and ``launch.run``.
"""
