"""The Triton kernels that are not the exchange's, and what picks and shapes them:
``triton_kernels`` (MXFP8 quantize / dequantize, every format's in-register encode / decode),
``quantize`` (quantize / dequantize as torch.library custom ops, Triton or the torch reference),
``launch_shapes`` (each kernel's launch shape, ``KernelShapes.default(fmt)``), ``check_kernels``
(the dispatcher's device checks; twin: ``dispatcher.checks.check_routing``) and
``expert_kernels`` (the grouped SwiGLU experts whose elementwise work covers only the received
rows).

May import ``format``, ``config`` and ``transport``; nothing above (``mxfp8_ep.LAYERS``).
"""
