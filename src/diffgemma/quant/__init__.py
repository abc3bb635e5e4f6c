"""Quantized packs: weight codecs, the pack format, the streaming quantizer and the pack TensorSource.

    from diffgemma.quant import quantize, PackSource, is_pack
    quantize("ckpt/", "ckpt-q4/", profile="q4", sets=["attn=q8"])
    src = PackSource("ckpt-q4/")          # TensorSource: keys/shape/dtype/get (dequantized)
"""

from .overlay import repack_monolithic, repack_overlay
from .quantize import quantize
from .source import PackSource, is_pack, open_pack

__all__ = ["quantize", "PackSource", "is_pack", "open_pack", "repack_monolithic", "repack_overlay"]
