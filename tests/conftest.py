import os

import torch

# Triton kernels run on the CPU through the Triton interpreter when there is no GPU. The flag
# is read when a kernel is defined (import time), so it is set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
