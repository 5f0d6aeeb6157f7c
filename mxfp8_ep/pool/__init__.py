"""The symm transport's activation pool: the expert-major tensors the experts save for backward,
kept at their routed rows in one pool per step (``activation_pool``), and its size as plain
numbers (``activation_pool_size``; torch-free, the recipe's memory check reads it).

May import ``dispatcher`` and everything below it; ``elastic`` and the torchtitan integrations
above import it (``mxfp8_ep.LAYERS``).
"""
