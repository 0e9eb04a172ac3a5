"""Redundancy on other nodes: partner copies (``partner``, streamed by ``transfer``) and
XOR / Reed-Solomon parity (``erasure`` over the code of ``stripes``, GF(256) arithmetic in
``gf256`` with Intel ISA-L through ``isal``)."""
