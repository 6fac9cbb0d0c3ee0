"""Training data: the embedded corpus, user text files, the train/val split and the byte tokenizer.

See ``docs/data_and_model.md`` for the corpus figures and the file formats.
"""

from flatshard.data.corpus import MIN_DOCSTRING_CHARS, embedded_documents
from flatshard.data.files import (
    SUFFIXES,
    TextDocuments,
    load_text_documents,
    read_text_documents,
)
from flatshard.data.split import train_val_split
from flatshard.data.tokenizer import ByteTokenizer

__all__ = [
    "MIN_DOCSTRING_CHARS",
    "SUFFIXES",
    "ByteTokenizer",
    "TextDocuments",
    "embedded_documents",
    "load_text_documents",
    "read_text_documents",
    "train_val_split",
]
