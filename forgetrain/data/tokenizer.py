"""The tokenizer protocol: what the data pipeline and the train loop need from a tokenizer, and the one factory.

Every tokenizer is a :class:`Tokenizer`: ``encode(text) -> list[int]`` (no BOS/EOS or other added tokens),
``decode(ids) -> str``, ``vocab_size``, ``eod_id`` / ``eod_piece`` (the end-of-document token that
``prepare`` appends to every document), ``token_to_id`` / ``id_to_piece`` (``None`` for a missing piece or
id, never a silent ``<unk>``), ``fingerprint()`` (its identity in the data cache key) and ``save(directory)``
(the exact bytes it was loaded from, under the backend's ``file_name``). :func:`load_tokenizer` picks the backend
for a file, by content first (an HF ``tokenizer.json`` is JSON, a SentencePiece model a protobuf that starts
with its ``pieces`` field) and by file name second; anything else is a one-line :class:`DataError`.

Backends and their end-of-document token:

* ``hf`` (``forgetrain/data/tokenizer_hf.py``): an HF ``tokenizers`` file. The EOD is the first of
  :data:`EOD_CANDIDATES` the vocabulary holds (``<|endoftext|>`` first, as in the BPE that ``prepare`` trains).
* ``sentencepiece`` (``forgetrain/data/tokenizer_sp.py``): a SentencePiece ``.model`` (e.g. Llama-2's). The EOD
  is the model's own end-of-sequence piece, ``sp.eos_id()`` (``</s>`` for Llama-2, whose documents end with
  it); only a model trained without one (``eos_id=-1``) falls back to :data:`EOD_CANDIDATES`. SentencePiece's
  ``piece_to_id`` answers the ``<unk>`` id for a piece it does not have, so that answer counts as missing.

A tokenizer without an end-of-document token cannot be loaded: the error names the file and the pieces looked
for. Adding a third backend touches two files: the backend module (a :class:`Tokenizer` subclass) and one line
in :func:`_backends` below.
"""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from typing import ClassVar, Iterable, Optional

from forgetrain.errors import DataError

EOD_TOKEN = "<|endoftext|>"  # the end-of-document token of the BPE prepare trains, and the first candidate
# Common spellings of an end-of-document token, tried in order where a backend looks one up by name.
DOCUMENT_BREAK = "\n[end of document]\n"  # how Tokenizer.render_documents shows an end-of-document token
EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
_SNIFF_BYTES = 64


class Tokenizer(ABC):
    """A loaded tokenizer, backend-independent. Subclasses set the class attributes and implement the methods.

    ``backend``: short name recorded in a prepared dataset's manifest. ``file_name``: the name ``save`` writes
    and that ``data.path`` looks for beside a dataset. ``description``: how error messages name the format.
    ``suffixes``: file-name endings that select this backend when the content does not.
    """

    backend: ClassVar[str]
    file_name: ClassVar[str]
    description: ClassVar[str]
    suffixes: ClassVar[tuple[str, ...]]

    def __init__(self, blob: bytes, where: str):
        self._blob = blob
        self.where = where  # how errors name it, e.g. "tokenizer '/path/tokenizer.model'"

    # ---------------------------------------------------------------------------------------- backend API
    @classmethod
    @abstractmethod
    def sniff(cls, head: bytes) -> bool:
        """True when ``head`` (the file's first bytes) looks like this backend's format."""

    @classmethod
    @abstractmethod
    def from_bytes(cls, blob: bytes, where: str) -> "Tokenizer":
        """Parse a whole file. Raises DataError (one line, naming ``where``) when it is not valid or has no EOD."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids (the embedding needs this many rows at least)."""

    @property
    @abstractmethod
    def eod_id(self) -> int:
        """Id of the end-of-document token (see the module docstring for each backend's rule)."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no BOS/EOS or other tokens are added."""

    @abstractmethod
    def _decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (ints); the EOD appears as ``eod_piece``, ids outside the vocabulary are skipped."""

    @abstractmethod
    def token_to_id(self, piece: str) -> Optional[int]:
        """Id of ``piece``, or None when the vocabulary does not hold it (never the ``<unk>`` id by accident)."""

    @abstractmethod
    def id_to_piece(self, i: int) -> Optional[str]:
        """The piece of id ``i``, or None when ``i`` is outside the vocabulary."""

    # ------------------------------------------------------------------------------------------- shared
    @property
    def eod_piece(self) -> str:
        """The end-of-document token as text (``<|endoftext|>``, ``</s>``, ...)."""
        return self.id_to_piece(self.eod_id)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``; backends override it with a faster batched call."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (a list, or a 1-D array or tensor of ids). Each EOD appears as ``eod_piece``; ids
        outside the vocabulary (rows of a larger embedding, e.g. in a sample) are skipped."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._decode([int(i) for i in ids])

    def render_documents(self, ids: Iterable[int]) -> str:
        """Readable text of ``ids`` for people (the end-of-run sample): each end-of-document token becomes a
        ``[end of document]`` line (:data:`DOCUMENT_BREAK`) between the documents' texts. :meth:`decode` keeps the
        raw ``eod_piece`` instead."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        docs, cur = [], []
        for i in (int(x) for x in ids):
            if i == self.eod_id:
                docs.append(cur)
                cur = []
            else:
                cur.append(i)
        docs.append(cur)
        texts = [self._decode(d) for d in docs]
        return DOCUMENT_BREAK.join(t.strip("\n") if k else t.rstrip("\n") for k, t in enumerate(texts))

    def fingerprint(self) -> dict:
        """Identity of this tokenizer for the data cache key: the sha256 of the file it was loaded from.

        Same bytes, same tokens: the backend is chosen from the bytes, and its EOD rule is fixed (a change to a
        rule bumps ``forgetrain.data.prepare.PREP_VERSION``). This is the key an HF file had before the protocol,
        so those cache entries stay valid.
        """
        return {"file_sha256": hashlib.sha256(self._blob).hexdigest()}

    def save(self, directory: str | os.PathLike) -> str:
        """Write the tokenizer's file, byte for byte, to ``directory/file_name``; returns that path."""
        from forgetrain.trace import atomic_write_bytes

        path = os.path.join(os.fspath(directory), self.file_name)
        atomic_write_bytes(path, self._blob)
        return path

    def _first_candidate(self) -> Optional[int]:
        """Id of the first of EOD_CANDIDATES this vocabulary holds, or None."""
        return next((i for t in EOD_CANDIDATES if (i := self.token_to_id(t)) is not None), None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.where}, vocab {self.vocab_size}, eod {self.eod_piece!r}={self.eod_id})"


# ----------------------------------------------------------------------------------------------- factory
def _backends() -> tuple[type[Tokenizer], ...]:
    """The registered backends, in the order the factory tries them. Registering a backend is one line here."""
    from forgetrain.data.tokenizer_hf import HFTokenizer
    from forgetrain.data.tokenizer_sp import SentencePieceTokenizer

    return HFTokenizer, SentencePieceTokenizer


def formats() -> str:
    """The readable formats in words, for messages: ``an HF tokenizer.json or a SentencePiece .model``."""
    names = [b.description for b in _backends()]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def file_names() -> tuple[str, ...]:
    """The file names a prepared dataset stores its tokenizer under, one per backend."""
    return tuple(b.file_name for b in _backends())


def backend_for(path: str | os.PathLike) -> type[Tokenizer]:
    """The backend that reads ``path``: the first whose ``sniff`` accepts its first bytes, else the first whose
    ``suffixes`` match its name. Raises DataError when the file is missing, unreadable or of neither kind."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"tokenizer '{path}' not found (expected {formats()})")
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
    except OSError as e:
        raise DataError(f"cannot read tokenizer '{path}': {e.strerror or e}") from None
    backends = _backends()
    by_content = [b for b in backends if b.sniff(head)]
    by_name = [b for b in backends if path.lower().endswith(b.suffixes)]
    if not (by_content or by_name):
        raise DataError(f"tokenizer '{path}' is not a tokenizer file (expected {formats()})")
    return (by_content or by_name)[0]


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load the tokenizer in ``path`` with the backend :func:`backend_for` picks.

    Raises DataError (one line, naming the file) when it is missing, not a tokenizer, corrupt, or has no
    end-of-document token.
    """
    path = os.fspath(path)
    cls = backend_for(path)
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError as e:
        raise DataError(f"cannot read tokenizer '{path}': {e.strerror or e}") from None
    return cls.from_bytes(blob, f"tokenizer '{path}'")


def find_beside(directory: str | os.PathLike) -> Optional[str]:
    """Path of the first tokenizer file (one of :func:`file_names`) in ``directory``, or None."""
    return next((p for n in file_names() if os.path.isfile(p := os.path.join(os.fspath(directory), n))), None)
