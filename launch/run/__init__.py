"""A run, from its launch to its last line: its folder (``run_dir``: what a run dir holds, run
and folder names, checkpoints, resumes), what it records (``run_summary``: ``summary.json``;
``wandb_offline``: its offline wandb runs read back; ``numerics_log``: the MXFP8 telemetry), what
it prints (``console``, ``heartbeat``), how it stops (``stop``) and continues (``resume``), and
ranks sharing one GPU (``shared_gpu``). Every layer above uses it; it imports only
``launch.config``.
"""
