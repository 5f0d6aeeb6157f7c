"""What a recipe config is, before anything runs: the typed schema Hydra composes into and the
config as YAML between processes (``schema``), how a mistake is worded and reported
(``problems``: ``ConfigError``, exit code 2), the models' numbers without torchtitan
(``model_facts``) and the estimates the checks hold against the machine (``memory``,
``step_time``). The lowest layer of ``launch``: it imports no other part of it, and no torch.
"""
