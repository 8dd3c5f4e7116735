"""cupyflash: exact FlashAttention (forward and backward) for CuPy, NumPy and DLPack arrays."""
from . import masks, mods
from .api import flash_attention, flash_attention_backward
from .dropout import dropout_mask
from .masks import BlockMask
from .kvcache import flash_attention_with_kvcache
from .merge import merge_attention
from .varlen import flash_attention_varlen, flash_attention_varlen_backward
from .mods import MaskMod, ScoreMod, SnippetError

__version__ = "0.1.0"
__all__ = ["flash_attention", "flash_attention_backward", "flash_attention_varlen",
           "flash_attention_varlen_backward", "flash_attention_with_kvcache", "merge_attention",
           "dropout_mask", "BlockMask", "masks", "mods",
           "ScoreMod", "MaskMod", "SnippetError"]
