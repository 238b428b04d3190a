"""The run's tokenizer: ``bytes`` (UTF-8 bytes, vocabulary 256: the main job's default), a Hugging
Face ``tokenizer.json`` (the ``tokenizers`` library) or a SentencePiece ``.model``.

A tokenizer is named by its ``spec`` (what ``--tokenizer`` was given) and known by its
``identity`` (kind and the file's SHA-256): the token cache and the checkpoint's record keep the
identity, so a cache made by another tokenizer is not reused and a checkpoint is not read with
another tokenizer's ids.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile

from jaxpar.errors import JaxparError

BYTES = "bytes"
BLANK_LINE = (10, 10)  # UTF-8 "\n\n": what separates two documents of a byte stream
KEPT = "tokenizer"  # a checkpoint directory keeps its run's tokenizer file under this name (+ .json or .model)


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    spec: str  # "bytes", or the file's path
    kind: str  # "bytes" | "tokenizers" | "sentencepiece"
    identity: str  # kind:sha256 of the file (bytes: "bytes")
    vocab_size: int
    end_id: int | None  # the id put between documents (None: none; bytes: a blank line is the separator)
    _impl: object = dataclasses.field(default=None, compare=False, repr=False)

    def encode(self, text: str) -> list[int]:
        if self.kind == BYTES:
            return list(text.encode("utf-8"))
        if self.kind == "tokenizers":
            return self._impl.encode(text, add_special_tokens=False).ids
        return self._impl.encode(text)

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]  # a padded vocabulary's extra ids are not text
        if self.kind == BYTES:
            return bytes(ids).decode("utf-8", errors="replace")
        return self._impl.decode(ids)

    def between_documents(self) -> list[int]:
        """The ids joined between two documents in a token stream."""
        return list(BLANK_LINE) if self.kind == BYTES else ([] if self.end_id is None else [self.end_id])


def load(spec: str) -> Tokenizer:
    """The tokenizer ``spec`` names; a file that cannot be read as one is refused, naming it."""
    if spec == BYTES:
        return Tokenizer(BYTES, BYTES, BYTES, 256, None)
    if not os.path.isfile(spec):
        raise JaxparError(f"--tokenizer {spec}: no such file; give 'bytes', a Hugging Face tokenizer.json or a "
                          f"SentencePiece .model file")
    with open(spec, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if spec.endswith(".json"):
        return _hugging_face(spec, digest)
    return _sentencepiece(spec, digest)


def _hugging_face(path: str, digest: str) -> Tokenizer:
    import tokenizers  # the `data` extra

    try:
        impl = tokenizers.Tokenizer.from_file(path)
    except Exception as err:  # the library raises a bare Exception on a malformed file
        raise JaxparError(f"--tokenizer {path} cannot be read as a Hugging Face tokenizer.json ({str(err)[:200]}); "
                          f"give the tokenizer.json saved with the model") from None
    end = next((impl.token_to_id(t) for t in ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>") if impl.token_to_id(t) is not None), None)
    return Tokenizer(path, "tokenizers", f"tokenizers:{digest}", impl.get_vocab_size(with_added_tokens=True), end, impl)


def _sentencepiece(path: str, digest: str) -> Tokenizer:
    import sentencepiece  # the `data` extra

    impl = sentencepiece.SentencePieceProcessor()
    try:
        impl.Load(path)
    except (OSError, RuntimeError) as err:
        raise JaxparError(f"--tokenizer {path} cannot be read as a SentencePiece model ({str(err)[:200]}); "
                          f"give a .model file, or a Hugging Face tokenizer.json") from None
    end = impl.eos_id()
    return Tokenizer(path, "sentencepiece", f"sentencepiece:{digest}", impl.get_piece_size(), end if end >= 0 else None, impl)


def keep(tokenizer: Tokenizer, directory: str) -> None:
    """Copy the tokenizer's file into ``directory`` (a run's checkpoint directory), so that its
    checkpoints are read with it wherever they are moved (``kept``); written whole or not at all."""
    if tokenizer.kind == BYTES:
        return
    target = os.path.join(directory, KEPT + (".json" if tokenizer.kind == "tokenizers" else ".model"))
    if os.path.exists(target) and load(target).identity == tokenizer.identity:
        return
    fd, part = tempfile.mkstemp(dir=directory, prefix=".tokenizer-")
    os.close(fd)
    shutil.copyfile(tokenizer.spec, part)
    os.replace(part, target)


def kept(directory: str, identity: str) -> Tokenizer:
    """The tokenizer a checkpoint in ``directory`` was trained with (its meta's ``identity``),
    from the file ``keep`` put there; refused if it is missing or another tokenizer's."""
    if identity == BYTES:
        return load(BYTES)
    for suffix in (".json", ".model"):
        path = os.path.join(directory, KEPT + suffix)
        if os.path.exists(path):
            tokenizer = load(path)
            if tokenizer.identity != identity:
                raise JaxparError(f"{path} is not the tokenizer the checkpoints in {directory} were trained with "
                                  f"({identity[:40]}...); put that tokenizer's file back there")
            return tokenizer
    raise JaxparError(f"the checkpoints in {directory} were trained with a tokenizer ({identity[:40]}...) whose file "
                      f"{KEPT}.json or {KEPT}.model is not there; copy the run's tokenizer file there under that name")
