"""SharedKVPool: a KVPool whose tensor lives in a POSIX shared-memory file under /dev/shm.

A prefill replica that builds its pool this way lets a decode replica on the same host map
the very same pages, so moving a block is one memcpy from the prefill's pool into the
decode's pool, with no staging buffer and no socket. ``pool.py`` stays untouched: the base
constructor runs on the ``meta`` device (validates, allocates nothing) and the tensor is then
replaced by one mapped from the file.

The creator unlinks the file on ``unlink()``, garbage collection or interpreter exit; pages
stay mapped for whoever still has them. A creator killed with SIGKILL leaves the file behind
(``splitserve-kv-<pid>-*`` in /dev/shm) for the operator to remove.
"""

from __future__ import annotations

import os
import uuid
import weakref
from pathlib import Path

import torch

from engine.kvcache.pool import KVLayout, KVPool
from services.kvtransfer.blockbytes import byte_view

SHM_DIR = Path("/dev/shm")
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


class SharedKVPool(KVPool):
    def __init__(self, layout: KVLayout, num_blocks: int, path: Path, *, owner: bool):
        super().__init__(layout, num_blocks, device="meta")
        numel = num_blocks * layout.block_numel
        nbytes = numel * torch.empty((), dtype=layout.dtype).element_size()
        if owner:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, nbytes)  # zero-filled, like KVPool's torch.zeros
            finally:
                os.close(fd)
        else:
            size = os.stat(path).st_size
            if size != nbytes:
                raise ValueError(
                    f"shared KV segment {path} holds {size} bytes, but {num_blocks} blocks of "
                    f"this layout need {nbytes}"
                )
        flat = torch.from_file(str(path), shared=True, size=numel, dtype=layout.dtype)
        self.tensor = flat.view(num_blocks, *layout.block_shape)
        self.path = path
        self.owner = owner
        self._unlinker = weakref.finalize(self, _unlink, path) if owner else None

    @classmethod
    def create(
        cls, layout: KVLayout, num_blocks: int, *, directory: Path = SHM_DIR
    ) -> SharedKVPool:
        path = directory / f"splitserve-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        return cls(layout, num_blocks, path, owner=True)

    @classmethod
    def attach(cls, path: Path | str, layout: KVLayout, num_blocks: int) -> SharedKVPool:
        """Maps a pool another process created; the mapping never unlinks the file.

        Every page is touched once here: a fresh mapping faults on each 4 KiB page at first
        access, which would otherwise make the first transfers out of it several times
        slower than a memcpy."""
        pool = cls(layout, num_blocks, Path(path), owner=False)
        byte_view(pool.tensor)[::_PAGE_BYTES].sum()
        return pool

    def unlink(self) -> None:
        if self._unlinker is not None:
            self._unlinker()


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
