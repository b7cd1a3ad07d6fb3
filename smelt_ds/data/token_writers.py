"""Writers of the token-file formats that :mod:`smelt_ds.data.token_files` reads.

**Megatron-LM indexed dataset** (MMIDIDX version 1, the layout in :mod:`smelt_ds.data.token_files`):
the ``.bin`` is the token ids of every sequence back to back, in the index's dtype; the ``.idx``
written by :func:`write_megatron_index` is what megatron-core's ``IndexedDatasetBuilder.finalize``
writes for the same sequences (byte for byte: tested against megatron-core): the header, then
``sequence_lengths`` int32, ``sequence_pointers`` int64 (byte offsets of the sequences stored back
to back from byte 0), ``document_indices`` int64 (a leading 0, then the sequence count after each
document). No sequence modes (text, not multimodal data).

**numpy ``.npy``** (``np.save``'s format, version 1.0): :func:`npy_header` is the header
``np.save`` writes for a 1-D array of ``n`` tokens; the ids follow it. numpy reserves room in the
header for the shape to grow (its ``GROWTH_AXIS_MAX_DIGITS``), so the header of 0 tokens and that
of any count up to 10^21 have the same length: a file written as it grows gets its final shape
written over the first one.

Sources: megatron-core ``megatron/core/datasets/indexed_dataset.py`` (``_IndexWriter``,
``DType.optimal_dtype``); numpy ``numpy.lib.format``.
"""

from __future__ import annotations

import io
import os
import struct
from pathlib import Path

import numpy as np

from smelt_ds.data.token_files import MEGATRON_DTYPES, MEGATRON_MAGIC

__all__ = ["megatron_dtype", "flat_dtype", "write_megatron_index", "npy_header", "write_npy_header", "NPY_HEADER_BYTES"]

_CHUNK = 1 << 20  # index entries written at once


def megatron_dtype(id_space: int) -> np.dtype:
    """The dtype Megatron-LM's ``tools/preprocess_data.py`` picks for a tokenizer of ``id_space``
    ids (``DType.optimal_dtype(vocab_size)``): uint16 below 65,500 ids, else int32."""
    return np.dtype(np.uint16) if id_space < 65_500 else np.dtype(np.int32)


def flat_dtype(id_space: int) -> np.dtype:
    """The dtype of a flat token file for a tokenizer of ``id_space`` ids: uint16 when every id fits
    (``id_space`` <= 65,536), else uint32 (the two dtypes :func:`~smelt_ds.data.token_files.open_flat`
    reads)."""
    return np.dtype(np.uint16) if id_space <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def _megatron_code(dtype: np.dtype) -> int:
    codes = {name: code for code, name in MEGATRON_DTYPES.items()}
    if np.dtype(dtype).name not in codes:
        raise ValueError(f"dtype {np.dtype(dtype).name} has no Megatron-LM DType code ({MEGATRON_DTYPES})")
    return codes[np.dtype(dtype).name]


def write_megatron_index(idx: str | os.PathLike, dtype: np.dtype, sequence_lengths: np.ndarray,
                         document_indices: np.ndarray | None = None) -> None:
    """Write the ``.idx`` of sequences stored back to back in a ``.bin`` of ``dtype`` tokens.

    ``sequence_lengths``: tokens per sequence, shape (S,), any integer array (a memory map is read
    :data:`_CHUNK` entries at a time); ``document_indices``: (D + 1,) int, rising from 0 to S
    (document d = sequences ``[di[d], di[d+1])``), or None for one sequence per document
    (``0, 1, ..., S``, generated chunk by chunk). The file is flushed and fsynced before it is
    closed. Raises ValueError for a dtype without a Megatron code.
    """
    dtype = np.dtype(dtype)
    seqs = len(sequence_lengths)
    docs = seqs + 1 if document_indices is None else len(document_indices)
    with open(idx, "wb") as f:
        f.write(MEGATRON_MAGIC + struct.pack("<QBQQ", 1, _megatron_code(dtype), seqs, docs))
        for a in range(0, seqs, _CHUNK):
            f.write(np.asarray(sequence_lengths[a:a + _CHUNK]).astype("<i4").tobytes())
        offset = 0  # byte offset of the next sequence in the .bin
        for a in range(0, seqs, _CHUNK):
            ln = np.asarray(sequence_lengths[a:a + _CHUNK]).astype(np.int64) * dtype.itemsize
            ends = np.cumsum(ln) + offset
            f.write((ends - ln).astype("<i8").tobytes())
            offset = int(ends[-1])
        for a in range(0, docs, _CHUNK):
            part = (np.arange(a, min(docs, a + _CHUNK), dtype=np.int64) if document_indices is None
                    else np.asarray(document_indices[a:a + _CHUNK]))
            f.write(part.astype("<i8").tobytes())
        f.flush()
        os.fsync(f.fileno())


def npy_header(dtype: np.dtype, num_tokens: int) -> bytes:
    """The header ``np.save`` writes for a 1-D array of ``num_tokens`` ids of ``dtype`` (format
    version 1.0, :data:`NPY_HEADER_BYTES` long for any count below 10^21)."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                               "fortran_order": False, "shape": (int(num_tokens),)})
    return buf.getvalue()


#: the length of :func:`npy_header` for the token dtypes (the same for 0 tokens and for 10^20)
NPY_HEADER_BYTES = len(npy_header(np.dtype(np.uint16), 0))


def write_npy_header(path: str | Path, dtype: np.dtype, num_tokens: int) -> None:
    """Write the final header of a ``.npy`` file grown from a header of 0 tokens over its first
    :data:`NPY_HEADER_BYTES` bytes. Raises ValueError if the header's length would change."""
    head = npy_header(dtype, num_tokens)
    if len(head) != NPY_HEADER_BYTES:
        raise ValueError(f"the .npy header of {num_tokens} tokens is {len(head)} bytes, not {NPY_HEADER_BYTES}")
    with open(path, "r+b") as f:
        f.write(head)
