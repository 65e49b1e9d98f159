"""Splitting a byte range of the collective's buffer into nearly equal, element-aligned chunks.

Chunk boundaries fall on multiples of :data:`ALIGNMENT_BYTES` (counted from the start of the
buffer), so that for any dtype up to 8 bytes wide every chunk is a whole number of elements when
the buffer is, and a runtime can slice tensors by ``offset_bytes // element_size``. The few bytes
that do not fill a whole granule go to the last chunk, so the sizes always add up exactly.
"""

from __future__ import annotations

from typing import NamedTuple

ALIGNMENT_BYTES = 8


class ByteRange(NamedTuple):
    """``size_bytes`` bytes of the buffer starting at ``offset_bytes``."""

    offset_bytes: int
    size_bytes: int

    @property
    def end_bytes(self) -> int:
        """One past the last byte of the range."""
        return self.offset_bytes + self.size_bytes


def split(whole: ByteRange, parts: int) -> tuple[ByteRange, ...]:
    """``whole`` cut into ``parts`` contiguous chunks, in order, covering it exactly.

    Each chunk holds ``floor(granules / parts)`` or one more granule of :data:`ALIGNMENT_BYTES`
    (the first chunks get the extra ones); the last chunk also takes the sub-granule remainder.
    Chunks may be empty when ``whole`` has fewer granules than ``parts``.

    Raises:
        ValueError: ``parts < 1``, or ``whole`` does not start on a granule boundary.
    """
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts")
    if whole.offset_bytes % ALIGNMENT_BYTES:
        raise ValueError(f"range starts at byte {whole.offset_bytes}, not a multiple of {ALIGNMENT_BYTES}")
    granules, remainder = divmod(whole.size_bytes, ALIGNMENT_BYTES)
    base, extra = divmod(granules, parts)
    chunks = []
    offset = whole.offset_bytes
    for index in range(parts):
        size = (base + (index < extra)) * ALIGNMENT_BYTES + (remainder if index == parts - 1 else 0)
        chunks.append(ByteRange(offset, size))
        offset += size
    return tuple(chunks)


def span(chunks: tuple[ByteRange, ...], first: int, stop: int) -> ByteRange:
    """The contiguous range covering ``chunks[first:stop]`` (``first < stop``)."""
    return ByteRange(chunks[first].offset_bytes, chunks[stop - 1].end_bytes - chunks[first].offset_bytes)
