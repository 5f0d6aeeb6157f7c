"""The recipe on torchtitan 0.3.0's trainer (``launch.titan.runner`` picks it where 0.3.0 is
installed): the job as 0.3.0's ``Trainer.Config`` (``job_config``), the trainer (``trainer``),
the models (``models``), the metrics processor (``metrics``) and what 0.3.0 needs to train in CPU
processes (``cpu_compat``). The EP exchange is the library's 0.3.0 override
(``mxfp8_ep.titan030.token_dispatcher``), the same one ``--override.imports`` puts on a plain
torchtitan run.
"""
