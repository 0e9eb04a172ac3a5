"""State capture: flatten state trees without pickle, RNG state, host staging buffers."""
from ftkit.capture.flatten import TensorLeaf, flatten, unflatten
from ftkit.capture.rng import RNGState
from ftkit.capture.staging import Stager

__all__ = ["RNGState", "Stager", "TensorLeaf", "flatten", "unflatten"]
