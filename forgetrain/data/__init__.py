"""Data pipeline: prepare a corpus into Megatron indexed datasets, then serve fixed-length token windows.

* :func:`prepare` -- ``DataConfig`` -> :class:`PreparedData` (train/valid prefixes, tokenizer, token counts).
* :class:`TokenWindows`, :func:`micro_batch`, :func:`eval_batches` -- samples in Megatron's pretraining order.
* :class:`Tokenizer`, :func:`load_tokenizer` -- the tokenizer protocol (HF ``tokenizers`` or SentencePiece).
"""

from forgetrain.data.loader import TokenWindows, eval_batches, inspect_indexed, micro_batch
from forgetrain.data.prepare import PreparedData, default_cache_dir, prepare
from forgetrain.data.tokenizer import DOCUMENT_BREAK, EOD_TOKEN, Tokenizer, load_tokenizer

__all__ = ["DOCUMENT_BREAK", "EOD_TOKEN", "PreparedData", "TokenWindows", "Tokenizer", "default_cache_dir", "eval_batches",
           "inspect_indexed", "load_tokenizer", "micro_batch", "prepare"]
