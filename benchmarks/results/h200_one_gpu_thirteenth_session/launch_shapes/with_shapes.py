"""Run a benchmark script with the MXFP8 reduce_slots launch shape from REDUCE_MXFP8 ("t,w,d")."""
import os
import runpy
import sys

import mxfp8_ep.symm_kernels as sk

spec = os.environ.get("REDUCE_MXFP8")
if spec:
    sk.REDUCE_SHAPES["mxfp8"] = tuple(int(v) for v in spec.split(","))
print("REDUCE_SHAPES", sk.REDUCE_SHAPES, flush=True)
sys.argv = sys.argv[1:]
sys.path.insert(0, os.getcwd())
runpy.run_path(sys.argv[0], run_name="__main__")
