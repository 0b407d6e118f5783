"""Data pipeline: prepare a corpus into Megatron indexed datasets, then serve fixed-length token windows.

* :func:`prepare` -- ``DataConfig`` -> :class:`PreparedData` (train/valid prefixes, tokenizer, token counts).
* :class:`TokenWindows`, :func:`micro_batch`, :func:`eval_batches` -- samples in Megatron's pretraining order.
* :func:`load_tokenizer`, :func:`encode`, :func:`decode` -- HF ``tokenizers`` helpers; :func:`render_documents`
  -- decoded text for people, document boundaries shown as ``[end of document]`` lines.
"""

from forgetrain.data.loader import (DOCUMENT_BREAK, EOD_TOKEN, TokenWindows, decode, encode, eod_id, eval_batches,
                                    inspect_indexed, load_tokenizer, micro_batch, render_documents)
from forgetrain.data.prepare import PreparedData, default_cache_dir, prepare

__all__ = ["DOCUMENT_BREAK", "EOD_TOKEN", "PreparedData", "TokenWindows", "decode", "default_cache_dir", "encode",
           "eod_id", "eval_batches", "inspect_indexed", "load_tokenizer", "micro_batch", "prepare", "render_documents"]
