"""cupyflash: exact FlashAttention (forward and backward) for CuPy, NumPy and DLPack arrays."""
from . import masks, mods
from .api import flash_attention, flash_attention_backward
from .dropout import dropout_mask
from .masks import BlockMask
from .mods import MaskMod, ScoreMod, SnippetError

__version__ = "0.1.0"
__all__ = ["flash_attention", "flash_attention_backward", "dropout_mask", "BlockMask", "masks",
           "mods", "ScoreMod", "MaskMod", "SnippetError"]
