"""Reading side of the data pipeline: indexed-dataset validation and the sample order.

A dataset is a Megatron indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``) whose documents each end with the EOD
token. :class:`TokenWindows` concatenates every document in stored order into one token stream and cuts it into
non-overlapping windows of ``seq_length + 1`` tokens (inputs ``[:-1]``, labels ``[1:]``); the tail that does not
fill a window is dropped. Global sample ``g`` is window ``perm_e[g % len]`` of epoch ``e = g // len``, where
``perm_e = np.random.RandomState(seed + e).permutation(len)``. :func:`micro_batch` maps (step, micro-batch, DP
rank) to global sample indices exactly like Megatron's pretraining sampler, so the order is a pure function of
the step and resuming needs no loader state.

Every problem with the files on disk is reported as a one-line :class:`DataError` naming the file.
"""

from __future__ import annotations

import os
import struct
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from forgetrain.errors import DataError

_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER = 34  # magic (9) + version (8) + dtype code (1) + sequence count (8) + document count (8)
# Megatron's DType codes that can hold token ids (6 = float64 and 7 = float32 cannot).
_TOKEN_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


# ----------------------------------------------------------------------------------------- indexed dataset
@dataclass(frozen=True)
class IndexedInfo:
    """What a validated ``PREFIX.idx`` describes: token dtype, sequence/document counts and total tokens."""

    dtype: type
    num_sequences: int
    num_documents: int
    num_tokens: int


def inspect_indexed(prefix: str) -> IndexedInfo:
    """Validate ``prefix.idx`` / ``prefix.bin`` without trusting either, and return their summary.

    Checks: both files exist; the .idx header (magic, version 1, an integer dtype); the .idx size matches the
    counts in its header; sequence pointers are the running sum of the lengths; document indices run from 0 to
    the sequence count; the .bin size equals total tokens x dtype size.
    Raises DataError (one line, naming the file) on any failure.
    """
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    if not (os.path.isfile(idx) and os.path.isfile(bin_)):
        raise DataError(f"data path '{prefix}' not found: expected {bin_} and {idx}")
    try:
        size = os.path.getsize(idx)
        with open(idx, "rb") as f:
            head = f.read(_IDX_HEADER)
        if len(head) < _IDX_HEADER:
            raise DataError(f"corrupt index '{idx}': {size} bytes, shorter than the {_IDX_HEADER}-byte header")
        if head[:9] != _IDX_MAGIC:
            raise DataError(f"corrupt index '{idx}': bad header (not a Megatron MMIDIDX index)")
        (version,) = struct.unpack("<Q", head[9:17])
        code = head[17]
        n_seq, n_doc = struct.unpack("<QQ", head[18:34])
        if version != 1:
            raise DataError(f"corrupt index '{idx}': unsupported version {version} (expected 1)")
        if code not in _TOKEN_DTYPES:
            raise DataError(f"corrupt index '{idx}': dtype code {code} is not an integer token type")
        expected = _IDX_HEADER + 12 * n_seq + 8 * n_doc
        if size not in (expected, expected + n_seq):  # + n_seq: multimodal files carry one mode byte per sequence
            raise DataError(f"corrupt index '{idx}': {size} bytes, but its header describes {n_seq} sequences "
                            f"and {n_doc} document indices = {expected} bytes (truncated or overwritten?)")
        lengths = np.fromfile(idx, dtype="<i4", count=n_seq, offset=_IDX_HEADER)
        pointers = np.fromfile(idx, dtype="<i8", count=n_seq, offset=_IDX_HEADER + 4 * n_seq)
        docs = np.fromfile(idx, dtype="<i8", count=n_doc, offset=_IDX_HEADER + 12 * n_seq)
        itemsize = np.dtype(_TOKEN_DTYPES[code]).itemsize
        if (lengths < 0).any() or n_doc < 1 or docs[0] != 0 or docs[-1] != n_seq or (np.diff(docs) < 0).any():
            raise DataError(f"corrupt index '{idx}': inconsistent sequence lengths or document indices")
        starts = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) * itemsize
        if not np.array_equal(pointers, starts):
            raise DataError(f"corrupt index '{idx}': sequence pointers do not match the sequence lengths")
        n_tok = int(lengths.sum(dtype=np.int64))
        bin_size = os.path.getsize(bin_)
    except OSError as e:
        raise DataError(f"cannot read '{prefix}': {first_line(e)}") from None
    if bin_size != n_tok * itemsize:
        raise DataError(f"corrupt data file '{bin_}': {bin_size} bytes, but '{idx}' describes {n_tok} tokens x "
                        f"{itemsize} bytes = {n_tok * itemsize} (truncated, or .bin and .idx do not belong together)")
    return IndexedInfo(_TOKEN_DTYPES[code], int(n_seq), int(n_doc) - 1, n_tok)


def max_token_id(prefix: str, info: IndexedInfo, chunk: int = 1 << 26) -> int:
    """The largest token id in ``prefix.bin`` (read in chunks of ``chunk`` tokens through a memory map; one pass,
    about a second per GB). -1 for an empty file. Raises DataError when the file cannot be read."""
    if info.num_tokens == 0:
        return -1
    try:
        arr = np.memmap(prefix + ".bin", dtype=info.dtype, mode="r", shape=(info.num_tokens,))
        return int(max(int(arr[i:i + chunk].max()) for i in range(0, info.num_tokens, chunk)))
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read '{prefix}.bin': {first_line(e)}") from None


def open_indexed(prefix: str):
    """Open a validated prefix with Megatron's mmap ``IndexedDataset``; any failure becomes a DataError."""
    try:
        with warnings.catch_warnings():  # megatron.core warns about missing Apex/TE on import
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import IndexedDataset
        return IndexedDataset(prefix, mmap=True)
    except Exception as e:
        raise DataError(f"cannot open indexed dataset '{prefix}': {first_line(e)}") from None


class TokenWindows:
    """Fixed-length training samples cut from an indexed dataset, in a seeded per-epoch order.

    Args:
        prefix: indexed-dataset prefix (``prefix.bin`` / ``prefix.idx``).
        seq_length: tokens per sample seen by the model; each window holds ``seq_length + 1`` tokens.
        seed: data-order seed; epoch ``e`` uses ``np.random.RandomState(seed + e).permutation(len(self))``.

    ``len(self)`` is the number of windows (one epoch). ``sample(g)`` / ``window(i)`` return int64 arrays of shape
    ``[seq_length + 1]``. ``num_tokens`` is the total token count of the dataset (EOD tokens included).

    Raises DataError when the files are missing or corrupt, or hold fewer than ``seq_length + 1`` tokens.
    """

    def __init__(self, prefix: str, seq_length: int, seed: int):
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        self.prefix, self.seq_length, self.seed = os.fspath(prefix), int(seq_length), int(seed)
        info = inspect_indexed(self.prefix)
        self.num_tokens, width = info.num_tokens, self.seq_length + 1
        self._n = info.num_tokens // width
        if self._n < 1:
            raise DataError(f"dataset '{self.prefix}' has {info.num_tokens} tokens, too small for "
                            f"seq_length={self.seq_length} (one sample needs {width} tokens)")
        # The .bin is read through numpy's memory map, not Megatron's IndexedDataset (open_indexed): the index is
        # validated above by our own parser, and a forged engine's process must load no Megatron module
        # (forgetrain.forge.runtime_guard). The same bytes either way: tokens 0 .. n*width of the stream.
        try:
            flat = np.memmap(self.prefix + ".bin", dtype=info.dtype, mode="r", shape=(self._n * width,))
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read '{self.prefix}.bin': {first_line(e)}") from None
        self._windows = flat.reshape(self._n, width)  # zero-copy view of the mmap
        self._epoch, self._perm = -1, None

    def __len__(self) -> int:
        return self._n

    def window(self, i: int) -> np.ndarray:
        """Window ``i`` in stored order: int64 ``[seq_length + 1]``. Raises IndexError outside ``[0, len)``."""
        if not 0 <= i < self._n:
            raise IndexError(f"window {i} out of range [0, {self._n})")
        return self._windows[i].astype(np.int64)

    def sample(self, g: int) -> np.ndarray:
        """Global sample ``g >= 0`` (any epoch): int64 ``[seq_length + 1]``."""
        if g < 0:
            raise IndexError(f"sample index must be >= 0, got {g}")
        epoch, pos = divmod(int(g), self._n)
        if epoch != self._epoch:
            self._perm = np.random.RandomState((self.seed + epoch) % 2**32).permutation(self._n)
            self._epoch = epoch
        return self.window(int(self._perm[pos]))


def micro_batch(windows: TokenWindows, step: int, micro: int, dp_rank: int, micro_batch_size: int, dp: int,
                global_batch_size: int) -> torch.Tensor:
    """The micro-batch that DP rank ``dp_rank`` consumes as micro-batch ``micro`` of optimizer step ``step``.

    ``step`` is 0-based. Row ``j`` is global sample ``step*GB + micro*MB*DP + dp_rank*MB + j`` (Megatron's
    pretraining sampler order). Returns an int64 tensor ``[micro_batch_size, seq_length + 1]``.
    Raises ValueError when ``micro`` or ``dp_rank`` is out of range for the batch sizes.
    """
    mb, gb = micro_batch_size, global_batch_size
    if mb < 1 or dp < 1 or gb % (mb * dp):
        raise ValueError(f"global_batch_size={gb} must be a positive multiple of micro_batch_size x DP = {mb} x {dp}")
    if not (0 <= micro < gb // (mb * dp) and 0 <= dp_rank < dp and step >= 0):
        raise ValueError(f"step={step}, micro={micro}, dp_rank={dp_rank} out of range for GB={gb}, MB={mb}, DP={dp}")
    base = step * gb + micro * mb * dp + dp_rank * mb
    return torch.from_numpy(np.stack([windows.sample(base + j) for j in range(mb)]))


def eval_batches(windows: TokenWindows, iters: int, micro_batch_size: int) -> list[torch.Tensor]:
    """``iters`` validation micro-batches, each int64 ``[micro_batch_size, seq_length + 1]``.

    They hold windows ``0 .. iters*MB - 1`` in stored order (no shuffle), so validation loss is comparable
    across runs and seeds. A dataset with fewer windows wraps around (window ``i % len``).
    """
    n = len(windows)
    return [torch.from_numpy(np.stack([windows.window((b * micro_batch_size + j) % n)
                                       for j in range(micro_batch_size)])) for b in range(iters)]


def first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__
