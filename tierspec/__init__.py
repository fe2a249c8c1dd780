"""tierspec: speculative decoding for Hugging Face causal LMs.

    >>> import tierspec
    >>> tierspec.generate("Name three primary colours.").text

Methods are (drafter, verification rule) pairs run by one decode loop (``tierspec.decode``).
"""

from .api import Generation, TextStream, generate, shared_model, stream
from .cached_model import CachedModel
from .decode import DecodeConfig, DecodeRun, GenerationStats, decode
from .errors import PromptError
from .methods import DEFAULT_METHOD, MethodOptions, UnknownMethodError, build_method, default_method, method_names
from .models import DEFAULT_MODEL, LoadedModel, ModelLoadError, load_model, wrap_model
from .sampling import SamplingConfig

__all__ = [
    "DEFAULT_METHOD",
    "default_method",
    "DEFAULT_MODEL",
    "CachedModel",
    "DecodeConfig",
    "DecodeRun",
    "Generation",
    "GenerationStats",
    "LoadedModel",
    "MethodOptions",
    "ModelLoadError",
    "PromptError",
    "SamplingConfig",
    "TextStream",
    "UnknownMethodError",
    "build_method",
    "decode",
    "generate",
    "load_model",
    "method_names",
    "shared_model",
    "stream",
    "wrap_model",
]
