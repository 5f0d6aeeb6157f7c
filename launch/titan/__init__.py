"""The torchtitan glue: what each training process runs. ``runner`` builds torchtitan's job from
the config and trains (``run_training``); ``models`` holds the recipe's model flavors, ``data`` its
datasets (the tiny tokenizer and text in ``assets/`` are package data), ``validation`` the
held-out loss, ``metrics`` the step metrics, wandb and console lines, ``cpu_compat`` what
torchtitan needs to train in CPU processes. It imports ``launch.config`` and ``launch.run``; the
launchers start it by name (``launch.launchers.worker``), not by import.
"""
