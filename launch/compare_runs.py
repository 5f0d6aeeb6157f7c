"""Compare finished runs: bf16 vs MXFP8 all-to-all, side by side, in a table, a JSON file and
plots (``python launch/compare_runs.py --help``). The command; the comparison itself is
``launch/tools/compare_runs.py``.
"""

from launch.tools.compare_runs import main

if __name__ == "__main__":
    raise SystemExit(main())
