"""What rows travel through between expert-parallel ranks, below the dispatchers that drive it:
``capacity`` (how many rows each buffer holds; torch-free, the recipe's memory check reads it),
``staging`` (the staging buffer's layout: rows, token map, row weights; rows in and out),
``routing`` (the expert-major layout from the counts), ``peer_memory`` (symmetric-memory peer
buffers; shared-memory files on CPU processes), ``symm_kernels`` (the push transports' Triton
kernels) with their torch twins ``symm_reference``, and ``all_to_all`` (``all_to_all_v``: a
differentiable all-to-all-v, each direction bf16 or MXFP8).

May import ``telemetry``, ``kernels``, ``config``, ``format`` and ``transport``; nothing above
(``mxfp8_ep.LAYERS``).
"""
