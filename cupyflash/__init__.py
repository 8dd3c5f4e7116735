"""cupyflash: exact FlashAttention (forward and backward) for CuPy, NumPy and DLPack arrays."""
from . import masks
from .api import flash_attention, flash_attention_backward
from .dropout import dropout_mask
from .masks import BlockMask

__version__ = "0.1.0"
__all__ = ["flash_attention", "flash_attention_backward", "dropout_mask", "BlockMask", "masks"]
