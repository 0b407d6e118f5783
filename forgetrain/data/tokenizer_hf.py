"""The HF ``tokenizers`` backend of the tokenizer protocol (:mod:`forgetrain.data.tokenizer`).

Reads a ``tokenizer.json`` (the format ``tokenizers.Tokenizer.save`` writes) and wraps the BPE that ``prepare``
trains. The end-of-document token is the first of ``EOD_CANDIDATES`` the vocabulary holds.
"""

from __future__ import annotations

from typing import Optional

from forgetrain.data.tokenizer import EOD_CANDIDATES, Tokenizer
from forgetrain.errors import DataError


class HFTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer``. ``encode`` adds no post-processor tokens; ``decode`` keeps special tokens."""

    backend = "hf"
    file_name = "tokenizer.json"
    description = "an HF tokenizer.json"
    suffixes = (".json",)

    def __init__(self, tok, blob: bytes, where: str):
        super().__init__(blob, where)
        self._tok = tok
        eod = self._first_candidate()
        if eod is None:
            raise DataError(f"{where} has no end-of-document token (looked for {', '.join(EOD_CANDIDATES)})")
        self._eod = eod

    @classmethod
    def sniff(cls, head: bytes) -> bool:
        return head.lstrip()[:1] == b"{"

    @classmethod
    def from_bytes(cls, blob: bytes, where: str) -> "HFTokenizer":
        from tokenizers import Tokenizer as _HF

        try:
            tok = _HF.from_str(blob.decode("utf-8"))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on bad JSON
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(f"{where} is not {cls.description}: {msg}") from None
        return cls(tok, blob, where)

    @classmethod
    def from_trained(cls, tok, where: str = "the trained BPE") -> "HFTokenizer":
        """Wrap a ``tokenizers.Tokenizer`` built in memory; ``save`` writes its pretty-printed JSON."""
        return cls(tok, tok.to_str(pretty=True).encode("utf-8"), where)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def eod_id(self) -> int:
        return self._eod

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_to_id(self, piece: str) -> Optional[int]:
        return self._tok.token_to_id(piece)

    def id_to_piece(self, i: int) -> Optional[str]:
        return self._tok.id_to_token(i)
