"""The SentencePiece backend of the tokenizer protocol (:mod:`forgetrain.data.tokenizer`).

Reads a SentencePiece ``.model`` (a serialized ``ModelProto``, e.g. Llama-2's ``tokenizer.model``). The
end-of-document token is the model's end-of-sequence piece (``eos_id()``, ``</s>`` for Llama-2). A model trained
with ``eos_id=-1`` has none; then the first of ``EOD_CANDIDATES`` that is a real piece is used. A real piece:
``piece_to_id`` answers the ``<unk>`` id for any string it does not know, so that answer means "missing".
"""

from __future__ import annotations

from typing import Optional

from forgetrain.data.tokenizer import EOD_CANDIDATES, Tokenizer
from forgetrain.errors import DataError


class SentencePieceTokenizer(Tokenizer):
    """A ``sentencepiece.SentencePieceProcessor``. ``encode`` adds no BOS/EOS; ``decode`` writes each EOD as its
    piece (SentencePiece itself drops control pieces, which would glue documents together)."""

    backend = "sentencepiece"
    file_name = "tokenizer.model"
    description = "a SentencePiece .model"
    suffixes = (".model",)

    def __init__(self, sp, blob: bytes, where: str):
        super().__init__(blob, where)
        self._sp = sp
        eos = sp.eos_id()
        eod = eos if eos >= 0 else self._first_candidate()
        if eod is None:
            raise DataError(f"{where} has no end-of-document token: its eos piece is disabled (eos_id=-1) and "
                            f"none of {', '.join(EOD_CANDIDATES)} is a piece (piece_to_id gives the <unk> id "
                            f"{sp.unk_id()})")
        self._eod = eod

    @classmethod
    def sniff(cls, head: bytes) -> bool:
        return head[:1] == b"\x0a"  # ModelProto field 1 (repeated pieces), length-delimited: always serialized first

    @classmethod
    def from_bytes(cls, blob: bytes, where: str) -> "SentencePieceTokenizer":
        import sentencepiece as spm

        try:  # the constructor form: a failed parse leaves no half-built processor (which logs to stderr later)
            sp = spm.SentencePieceProcessor(model_proto=blob)
        except Exception:  # noqa: BLE001 - RuntimeError with a C++ source location as its message
            raise DataError(f"{where} is not {cls.description} (it does not parse as a SentencePiece ModelProto)") \
                from None
        if sp.get_piece_size() == 0:  # an empty file parses as an empty model
            raise DataError(f"{where} is not {cls.description} (it holds no pieces)")
        return cls(sp, blob, where)

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod_id(self) -> int:
        return self._eod

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(list(texts), out_type=int)

    def _decode(self, ids: list[int]) -> str:
        n, parts, cur = self.vocab_size, [], []
        for i in ids:
            if i == self._eod:
                parts.append(self._sp.decode(cur))
                cur = []
            elif 0 <= i < n:  # like HF, ids outside the vocabulary (a larger embedding's rows) are skipped
                cur.append(i)
        parts.append(self._sp.decode(cur))
        return self.eod_piece.join(parts)

    def token_to_id(self, piece: str) -> Optional[int]:
        i = self._sp.piece_to_id(piece)
        return None if i == self._sp.unk_id() and piece != self._sp.id_to_piece(i) else i

    def id_to_piece(self, i: int) -> Optional[str]:
        return self._sp.id_to_piece(i) if 0 <= i < self.vocab_size else None
