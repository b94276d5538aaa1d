"""blockspec: an LLM serving engine built around DFlash speculative decoding."""
from blockspec.engine.engine import Engine
from blockspec.request import SamplingParams

__all__ = ["Engine", "SamplingParams"]
__version__ = "0.1.0"
