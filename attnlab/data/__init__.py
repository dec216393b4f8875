"""Datasets: text corpora and the tokenised language-modelling stream."""

from attnlab.data.corpus import (
    DOCUMENT_SEPARATOR,
    EMBEDDED_NAME,
    DataError,
    default_corpus,
    default_documents,
    read_corpus,
)
from attnlab.data.lm import TokenDataset, default_cache_dir, prepare_data, token_dtype

__all__ = [
    "DOCUMENT_SEPARATOR",
    "EMBEDDED_NAME",
    "DataError",
    "TokenDataset",
    "default_cache_dir",
    "default_corpus",
    "default_documents",
    "prepare_data",
    "read_corpus",
    "token_dtype",
]
