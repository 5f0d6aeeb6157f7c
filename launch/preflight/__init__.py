"""From the command line to a launch, in the launching process, before any training process
starts: Hydra's config store and resolvers (``config_store``), Hydra's composition errors in the
recipe's words (``hydra_errors``), every check of the composed config (``validate``: about a
second, without torch), the launch config with its resume, run id and name (``prepare``) and the
Hydra callbacks that do this for every point of a sweep (``callbacks``). It may import every
layer below it: the checks ask the launchers, the datasets and the estimates.
"""
