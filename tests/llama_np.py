"""The NumPy Llama of the suite: ``rocmforge_raw.demo.llama`` (one copy of the code, which the
disaggregated demo serves), re-exported under the name the tests import."""

from rocmforge_raw.demo.llama import Llama, LlamaShape, random_weights, rms_norm, rope, weights_of

__all__ = ["Llama", "LlamaShape", "random_weights", "rms_norm", "rope", "weights_of"]
