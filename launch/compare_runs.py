"""Compare finished runs: bf16 vs MXFP8 all-to-all, side by side, in a table, a JSON file and
plots (``python launch/compare_runs.py --help``). The command; the comparison itself is
``launch/tools/compare_runs.py``.
"""

import os

try:  # the package, or where it cannot be imported, the file beside this one
    from launch.recipe_python import require_recipe_python
except ImportError:
    import importlib.util as _util

    _spec = _util.spec_from_file_location("recipe_python", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                         "recipe_python.py"))
    _module = _util.module_from_spec(_spec)  # type: ignore[arg-type]
    _spec.loader.exec_module(_module)  # type: ignore[union-attr]
    require_recipe_python = _module.require_recipe_python

require_recipe_python(("omegaconf", "launch"))

from launch.tools.compare_runs import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
