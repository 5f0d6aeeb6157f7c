"""Reading finished runs: ``compare_runs`` (the table, verdicts, ``comparison.json`` and plots
behind ``python launch/compare_runs.py``), ``wandb_dashboard`` (the saved wandb workspace) and
``dashboard_preview`` (its picture). The top layer: it reads what ``launch.run`` records and
imports no training code.
"""
