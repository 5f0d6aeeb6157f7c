"""What the library counts while it runs, for the recipe to log: ``numerics`` (the quantization
telemetry: the probe the dispatchers report MXFP8 rows to, its statistics), ``wire_stats`` (the
bytes each leg put on the wire, host-side, no sync) and ``routing_stats`` (expert and rank loads
from the routing counts).

May import ``format``, ``config``, ``kernels`` and ``transport``; nothing above
(``mxfp8_ep.LAYERS``).
"""
