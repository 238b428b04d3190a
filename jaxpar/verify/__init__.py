"""Formal bounds on a network's outputs over regions of inputs, on one device or under a layout:
IBP, CROWN and alpha-CROWN (``bound``) for chains of dense, convolution and ReLU layers written in
Flax NNX (``from_nnx``) or read from ONNX; properties in VNN-LIB. See ``sharded`` for the layouts."""

from jaxpar.verify.network import Network, NetworkError, from_nnx
from jaxpar.verify.sharded import METHODS, Program, Result, bound, compile_bound, linf_ball

__all__ = ["METHODS", "Network", "NetworkError", "Program", "Result", "bound", "compile_bound", "from_nnx", "linf_ball"]
