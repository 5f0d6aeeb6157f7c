"""The wire formats: what a row is on the wire. ``wire_format`` names each format (``WireFormat``)
and holds its facts (row bytes, block, element and scale types, the constants its kernels read,
its codec module; no torch); ``mxfp8`` is MXFP8 in torch on any device: the reference the
kernels are checked against and ``WireFormat.MXFP8``'s codec.

The lowest part of the library but ``transport``: it imports nothing else of ``mxfp8_ep``.
"""
