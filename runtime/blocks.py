"""Weight blocks on disk, and the loader that streams them back into a rank's model.

Under a ``sliding_window`` memory policy (:class:`sim.plan.MemoryPolicy`) a rank's shard is split
into blocks, one decoder layer's ``attention`` or ``mlp`` weights (:func:`runtime.weights.block_of`).
:class:`BlockStore` writes each block once as a safetensors file, from the very tensors
:class:`~runtime.model.RankModel` builds, into a cache directory keyed by model, tensor-parallel
degree, rank index, dtype and seed; later runs reuse the files. :class:`BlockLoader` reads a block
back, as the executor's loader thread does for every ``weight_load`` op.

The loader really reads the disk: after each file is read (and after it is written) its pages are
dropped from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``), so the next load of the block
is not served from memory. Its reads are paced to the scenario's loader link by a
:class:`runtime.pacing.Pacer`: a block of B bytes takes at least ``latency_s + B / bandwidth`` from
its start, the way ``tc`` shapes the testbed's network. On a GPU the block is read into pinned host
memory and copied to the device on a CUDA stream of its own, so the copy overlaps the compute
stream.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from runtime.device import device_of
from runtime.model import RankModel
from runtime.pacing import CHUNK_BYTES, Pacer

# Bump when RankModel changes how it names, shards or fuses tensors: old cache files then no longer
# match any directory name and are never read.
_LAYOUT_VERSION = 1
# safetensors dtype codes (https://github.com/huggingface/safetensors, format in its README).
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
# name -> (dtype, shape, first byte, end byte) within the file's data section.
_Layout = dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]


def default_cache_dir() -> Path:
    """Where block files go unless a directory is given: ``<system temp dir>/hetsim-blocks``."""
    return Path(tempfile.gettempdir()) / "hetsim-blocks"


class BlockStore:
    """The block files of ``model``'s shard, under ``cache_dir`` (default :func:`default_cache_dir`).

    ``directory`` is ``<cache_dir>/<model>-tp<T>-r<index>-<dtype>-seed<S>-<digest>``, the digest
    covering the whole model spec and the rank's shard, so two specs that share a name, or an even
    and an uneven split, never share files. Files are
    named after their block, ``layer3.mlp.safetensors``.
    """

    def __init__(self, model: RankModel, cache_dir: str | Path | None = None):
        self.model = model
        spec = model.spec
        digest = hashlib.sha256(f"{_LAYOUT_VERSION}:{spec!r}:{model.shard!r}".encode()).hexdigest()[:10]
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", spec.name)
        dtype = str(model.dtype).removeprefix("torch.")
        key = f"{name}-tp{model.tp_degree}-r{model.rank_index}-{dtype}-seed{model.seed}-{digest}"
        self.directory = Path(cache_dir if cache_dir is not None else default_cache_dir()) / key

    def path(self, block: str) -> Path:
        return self.directory / f"{block}.safetensors"

    def write_missing(self) -> list[str]:
        """Write every block whose file is absent, one block in memory at a time; returns the
        blocks written. Each file is written to a temporary name and renamed, so a reader (or a
        concurrent writer) never sees a partial file."""
        self.directory.mkdir(parents=True, exist_ok=True)
        written = []
        for block in self.model.block_names:
            path = self.path(block)
            if path.exists():
                continue
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                save_file(self.model.block_shard(block), str(tmp), metadata={"block": block})
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)  # dirty pages cannot be dropped; written back, they can
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            written.append(block)
        return written

    def read(self, block: str, buffer_of_size: Callable[[int], torch.Tensor],
             pacer: Pacer | None = None) -> tuple[torch.Tensor, _Layout, int]:
        """Read ``block``'s data section into ``buffer_of_size(nbytes)`` (a uint8 CPU tensor of at
        least that many bytes) and drop the file from the page cache; returns the buffer, where each
        tensor lies in it, and the bytes read. With a ``pacer``, each chunk of the data is read,
        then held until the pacer says it has arrived.

        The data is read straight into the buffer (one copy, no intermediate ``bytes``), which is
        why this parses the safetensors header itself: 8 bytes little-endian header length, a JSON
        header, then the data. Raises FileNotFoundError if the block was never written.
        """
        fd = os.open(self.path(block), os.O_RDONLY)
        try:
            (header_len,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            header = json.loads(os.pread(fd, header_len, 8))
            header.pop("__metadata__", None)
            data_start = 8 + header_len
            nbytes = os.fstat(fd).st_size - data_start
            buffer = buffer_of_size(nbytes)
            view, done = memoryview(buffer.numpy()), 0
            while done < nbytes:
                chunk_end = min(done + CHUNK_BYTES, nbytes)
                arrival = pacer.chunk(chunk_end - done) if pacer is not None else 0.0
                while done < chunk_end:
                    count = os.preadv(fd, [view[done:chunk_end]], data_start + done)
                    if count == 0:
                        raise EOFError(f"{self.path(block)} ends after {done} of {nbytes} data bytes")
                    done += count
                wait_s = arrival - time.perf_counter()
                if wait_s > 0:
                    time.sleep(wait_s)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        layout = {name: (_DTYPES[entry["dtype"]], tuple(entry["shape"]), *entry["data_offsets"])
                  for name, entry in header.items()}
        return buffer, layout, nbytes


def _views(buffer: torch.Tensor, layout: _Layout) -> dict[str, torch.Tensor]:
    """The tensors of a block as views of its one buffer, so the block's memory is one allocation
    that is freed when the last of its tensors is. safetensors aligns each tensor to its element
    size; a file that does not gets a copy instead of a view."""
    tensors = {}
    for name, (dtype, shape, first, end) in layout.items():
        raw = buffer[first:end]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if first % itemsize:
            raw = raw.clone()
        tensors[name] = raw.view(dtype).view(shape)
    return tensors


class BlockLoader:
    """Loads blocks of ``store`` onto ``device``, paced by ``pacer`` (None: as fast as the disk).

    Used from one thread at a time (the executor's loader thread, or before a generation). On a GPU
    it reuses one pinned staging buffer, so each load waits for its copy to finish before returning
    (which is also when the block is really there, the load's end in the trace); the consumer then
    needs no device-side wait.
    """

    def __init__(self, store: BlockStore, device: torch.device | str, pacer: Pacer | None = None):
        self.store, self.device, self.pacer = store, torch.device(device), pacer
        self._device = device_of(self.device)
        self._staging = torch.empty(0, dtype=torch.uint8)

    def load(self, block: str) -> tuple[dict[str, torch.Tensor], int]:
        """Read ``block`` (cache dropped), paced, and place it on the device; returns its tensors
        and its bytes."""
        if self.pacer is not None:
            self.pacer.start_load()
        return self._read(block, self.pacer)

    def fetch(self, block: str) -> tuple[dict[str, torch.Tensor], int]:
        """:meth:`load` without the pacing (for weights made resident before timing starts)."""
        return self._read(block, None)

    def _read(self, block: str, pacer: Pacer | None) -> tuple[dict[str, torch.Tensor], int]:
        if not self._device.uses_staging():
            buffer, layout, nbytes = self.store.read(block, lambda n: torch.empty(n, dtype=torch.uint8), pacer)
            return _views(buffer, layout), nbytes
        staging, layout, nbytes = self.store.read(block, self._staging_of_size, pacer)
        # The copy is complete on return: the staging buffer is reused by the next load.
        return _views(self._device.to_device(staging, nbytes), layout), nbytes

    def _staging_of_size(self, nbytes: int) -> torch.Tensor:
        if self._staging.numel() < nbytes:
            self._staging = self._device.staging(nbytes)
        return self._staging
