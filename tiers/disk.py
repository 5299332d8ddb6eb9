"""The disk tier: one authenticated file per block on a local path, reusable after a restart.

Layout: ``root/ab/cd/<keyhex>.kvb`` (``tiers.disk_layout``). Files are 0600 in 0700
directories: stored KV can be inverted back into the prompt, so it is as sensitive as the prompt.

Writes stay off the request path. ``put`` only queues the block (bounded by bytes; when the
queue is full the put is dropped and counted, never waited on); one writer thread encodes it
(``tiers.codec``), writes a temp file in the block's directory, fsyncs it, renames it over the
final name and fsyncs the directory. Only then is the block durable and in the index. Until
then it is served from the pending map, so a block is readable as soon as ``put`` returns,
and a reader never sees a partial file: temp names are never read and the final name appears
only through an atomic rename of a complete, fsynced file.

Failures are misses, never errors for the caller:

* a write that fails (EIO on write/fsync/rename) is discarded: its temp file is unlinked, it
  is never retried nor published, and its key is reported by ``drain_failed`` so the index
  forgets it;
* a full, read-only or forbidden disk (ENOSPC, EDQUOT, EROFS, EACCES, EPERM) stops writes with
  one warning; puts are dropped (counted) until ``retry_after_s`` has passed on the injected
  clock, when the next put tries again. Reads keep working throughout;
* a file that does not verify on ``get`` (``CodecError``) is a counted miss and is deleted.

Restart: ``recover`` (run by ``start``) scans the root (``tiers.disk_recovery``):
deletes leftover temp files, reads only the header of each block file, checks its
header MAC, layout, size and that its name is its key, deletes what fails (an old
format version too) and returns the good headers for the prefix cache to adopt. The
block MAC over header and payload is verified on ``get``: one small read per block here.

Locks: ``_lock`` guards every map and counter and is never held across a slow syscall except
the unlink that removes a file whose key it must keep consistent with the index. ``_io_lock``
serialises the writer's file operations with ``recover``'s scan, so a scan never races a
rename; readers never take it.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType

from gateway.core.admin_reports import StoreReport
from policies.base import BlockKey
from tiers.base import BatchDefaults, BlockMeta, CodecError, StoreCounters, TierConfigError
from tiers.codec import BlockCodec, DecodedHeader
from tiers.disk_layout import ShardLayout
from tiers.disk_recovery import scan_root
from tiers.fileops import FileOps, RealFileOps, write_temp
from tiers.payload import KVBlock, PayloadError

logger = logging.getLogger(__name__)

UNAVAILABLE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
"""Errors that say the disk cannot take writes for a while (rather than that one write failed)."""



@dataclass(eq=False, slots=True)
class _Write:
    """One queued put. Identity matters: a newer put of the same key is another object."""

    meta: BlockMeta
    block: KVBlock
    nbytes: int
    is_cancelled: bool = False


@dataclass(frozen=True, slots=True)
class _Durable:
    """An index entry: a published file. Compared by identity to detect republishing."""

    num_bytes: int


@dataclass(frozen=True, slots=True)
class _Outage:
    """Writes are stopped after an ENOSPC-class error until ``retry_at`` (clock seconds)."""

    errno_name: str
    retry_at: float


class DiskStore(BatchDefaults):
    """Block payloads as files under ``root`` (see the module docstring).

    Args:
        root: the directory of this store. Created (0700) by ``start`` when missing.
        codec: encodes and verifies block files; carries the MAC key and the model layout.
        fileops: the filesystem seam (``RealFileOps`` by default).
        fsync: fsync files and directories before a block counts as durable. Off only for
            throwaway caches: a power loss may then lose any block (never serve a bad one).
        max_pending_bytes: bound on the payload bytes queued for writing; puts beyond it are
            dropped (``dropped_backpressure``), never blocked.
        retry_after_s: after a disk-full / read-only error, puts are dropped for this long.
        clock: monotonic seconds (injected for tests).
        name: the store's name in stats.
    """

    def __init__(
        self,
        root: Path | str,
        codec: BlockCodec,
        *,
        fileops: FileOps | None = None,
        fsync: bool = True,
        max_pending_bytes: int = 256 << 20,
        retry_after_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        name: str = "disk",
    ) -> None:
        if max_pending_bytes < 1:
            raise TierConfigError(f"max_pending_bytes must be >= 1, got {max_pending_bytes}")
        if not retry_after_s >= 0:
            raise TierConfigError(f"retry_after_s must be >= 0, got {retry_after_s}")
        self.name = name
        self._root = os.path.abspath(os.fspath(root))
        self._codec = codec
        self._ops: FileOps = fileops if fileops is not None else RealFileOps()
        self._is_fsync = fsync
        self._layout = ShardLayout(self._root, self._ops, fsync=fsync)
        self._max_pending_bytes = max_pending_bytes
        self._retry_after_s = retry_after_s
        self._clock = clock

        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._io_lock = threading.Lock()
        self._queue: deque[_Write] = deque()
        self._pending: dict[BlockKey, _Write] = {}
        self._index: dict[BlockKey, _Durable] = {}
        self._num_index_bytes = 0
        self._num_outstanding = 0  # queued + in flight
        self._pending_bytes = 0
        self._failed: list[BlockKey] = []
        self._outage: _Outage | None = None
        self._last_error_log_at: float | None = None
        self._stats = StoreCounters(name=name)
        self._counts: Counter[str] = Counter()
        self._recovered_at_start: list[DecodedHeader] = []
        self._state = "new"  # new -> running -> closed
        self._is_stopping = False
        self._is_writer_dead = False
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def root(self) -> Path:
        return Path(self._root)

    def start(self) -> None:
        """Create the root, recover what is on disk, start the writer thread.

        Raises:
            TierConfigError: the root exists and is not a directory (or cannot be one). A root
                that exists but cannot be written (read-only mount, permissions, full disk)
                does not raise: the store starts with writes stopped and serves what it has.
        """
        with self._lock:
            if self._state != "new":
                raise RuntimeError(f"DiskStore.start() called in state {self._state!r}")
        try:
            self._layout.make_dirs(self._root)
            self._ops.scandir(self._root)
        except (FileExistsError, NotADirectoryError) as exc:
            raise TierConfigError(
                f"disk tier root {self._root} exists and is not a directory; "
                "point the disk tier at a directory of its own"
            ) from exc
        except OSError as exc:
            if exc.errno not in UNAVAILABLE_ERRNOS:
                raise TierConfigError(
                    f"disk tier root {self._root} cannot be created: {exc.strerror}"
                ) from exc
            self._enter_outage(exc)
        else:
            self._layout.mark_root_known()
            self._probe_writable()
        self._recovered_at_start = self.recover()
        thread = threading.Thread(target=self._run, name=f"kvgate-{self.name}-writer", daemon=True)
        with self._lock:
            self._state = "running"
            self._thread = thread
        thread.start()

    def take_recovered(self) -> list[DecodedHeader]:
        """The headers ``start`` recovered (once: later calls return nothing), so that the
        caller can re-index them without scanning the directory a second time."""
        recovered, self._recovered_at_start = self._recovered_at_start, []
        return recovered

    def close(self, timeout_s: float | None = None) -> None:
        """Write out what is queued (waiting up to ``timeout_s``), then stop the writer.

        Blocks still queued after the timeout are dropped and reported by ``drain_failed``.
        """
        with self._lock:
            if self._state == "closed":
                return
            was_running = self._state == "running"
            self._state = "closed"
        if not was_running:
            return
        self.flush(timeout_s)
        with self._changed:
            self._is_stopping = True
            self._changed.notify_all()
        assert self._thread is not None
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning(
                "disk tier %s: writer still busy after close(%s s)", self._root, timeout_s
            )

    def __enter__(self) -> DiskStore:
        if self._state == "new":
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued write has finished (written, failed or dropped).

        Returns:
            True when the queue is empty, False on timeout or when the writer has died.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._changed:
            while self._num_outstanding and not self._is_writer_dead:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._changed.wait(remaining)
            return self._num_outstanding == 0

    # -- BlockStore --------------------------------------------------------------------------

    def put(self, meta: BlockMeta, block: KVBlock) -> None:
        """Queue the block for writing; returns at once. Drops (and counts) what cannot fit.

        Blocks are read-only once computed (``BlockStore``), so the tensors are kept as they
        are until the writer has encoded them; no copy is made on the caller's thread.
        """
        key = meta.key
        nbytes = block.nbytes
        with self._changed:
            if self._state == "new":
                raise RuntimeError("DiskStore.put() before start()")
            self._stats.puts += 1
            if key in self._pending or key in self._index:
                # Keys address content: the same key is the same block, already on its way.
                self._counts["puts_already_present"] += 1
                return
            if self._state == "closed" or self._is_writer_dead:
                self._drop_locked(key, "dropped_closed")
                return
            if self._outage is not None and self._clock() < self._outage.retry_at:
                self._drop_locked(key, "dropped_unavailable")
                return
            if self._pending_bytes + nbytes > self._max_pending_bytes:
                self._drop_locked(key, "dropped_backpressure")
                return
            write = _Write(meta=meta, block=block, nbytes=nbytes)
            self._pending[key] = write
            self._queue.append(write)
            self._pending_bytes += nbytes
            self._num_outstanding += 1
            self._changed.notify_all()

    def get(self, meta: BlockMeta, *, into: KVBlock | None = None) -> KVBlock | None:
        """The block if it is pending or on disk and verifies against ``meta``; else None (one
        read from its file is decoded into ``into``, a page of the pool, and returned as it)."""
        key = meta.key
        with self._lock:
            write = self._pending.get(key)
            durable = self._index.get(key) if write is None else None
            reason = None if write is None else _meta_mismatch(write.meta, meta)
            if reason is not None:
                self._stats.count_failure(reason)
            if reason is not None or (write is None and durable is None):
                self._stats.misses += 1
                return None
            if write is not None:
                self._stats.hits += 1
                self._counts["hits_pending"] += 1
        if write is not None:  # served as it will be once written (a lossy tier's copy)
            return self._codec.stored_copy(write.block)
        assert durable is not None
        path = self._layout.path_for(key)
        try:
            data = self._ops.read(path, durable.num_bytes + 1)
        except FileNotFoundError:
            with self._lock:
                self._stats.misses += 1
                self._counts["vanished_files"] += 1
                self._forget_locked(key, durable)
            return None
        except OSError as exc:
            with self._lock:
                self._stats.misses += 1
                self._stats.errors += 1
                self._counts["read_errors"] += 1
            logger.debug("disk tier %s: read failed: %s", self._root, exc.strerror)
            return None
        try:
            block = self._codec.decode(data, meta, into=into)
        except CodecError as exc:
            with self._lock:
                self._stats.misses += 1
                self._stats.count_failure(exc.reason)
                if self._index.get(key) is durable and key not in self._pending:
                    self._forget_locked(key, durable)
                    self._unlink_quietly(path)
            logger.debug("disk tier %s: block failed verification (%s)", self._root, exc.reason)
            return None
        with self._lock:
            self._stats.hits += 1
        return block

    def delete(self, key: BlockKey) -> None:
        """Forget the block: cancel its pending write and remove its file (if any)."""
        path = self._layout.path_for(key)
        with self._lock:
            write = self._pending.pop(key, None)
            if write is not None:
                write.is_cancelled = True
            durable = self._index.get(key)
            if durable is not None:
                self._forget_locked(key, durable)
            if write is not None or durable is not None:
                self._stats.deletes += 1
            # NOTE: under the lock, so a put of the same key cannot be published in between
            # and then lose its file to this unlink.
            self._unlink_quietly(path)

    def contains(self, key: BlockKey) -> bool:
        with self._lock:
            return key in self._pending or key in self._index

    def stats(self) -> StoreReport:
        with self._lock:
            notes: dict[str, int | float | str] = dict(self._counts)
            notes["pending_bytes"] = self._pending_bytes
            notes["pending_blocks"] = len(self._pending)
            notes["queued_writes"] = self._num_outstanding
            if self._outage is not None:
                notes["unavailable_reason"] = self._outage.errno_name
            return replace(
                self._stats.report(),
                num_blocks=len(self._index),
                num_bytes=self._num_index_bytes,
                is_available=self._outage is None and not self._is_writer_dead,
                notes=notes,
            )

    def drain_failed(self) -> list[BlockKey]:
        """Keys whose put was dropped or whose write failed since the last call.

        The prefix cache uses this to forget the disk copy it assumed on ``put``.
        """
        with self._lock:
            failed, self._failed = self._failed, []
            return failed

    # -- recovery ----------------------------------------------------------------------------

    def recover(self) -> list[DecodedHeader]:
        """Scan the root (``tiers.disk_recovery``): delete temp and invalid block files, index
        the valid ones (one header read and one stat per file; the block MAC waits for ``get``).

        Returns:
            The headers of the block files kept, for the caller to rebuild its index.
        """
        with self._io_lock:
            found = scan_root(self._layout, self._ops, self._codec)
            with self._lock:
                for path in found.leftovers:
                    self._counts["temp_files_removed"] += 1
                    self._unlink_quietly(path)
                for path, reason in found.invalid:
                    self._stats.count_failure(reason)
                    self._counts["recovery_removed"] += 1
                    self._unlink_quietly(path)
                if found.num_unknown_files:
                    self._counts["unknown_files"] += found.num_unknown_files
                if found.num_read_errors:
                    self._stats.errors += found.num_read_errors
                    self._counts["read_errors"] += found.num_read_errors
                self._index = {key: _Durable(num_bytes=header.total_len)
                               for key, header in found.key_to_header.items()}
                self._num_index_bytes = sum(d.num_bytes for d in self._index.values())
                self._counts["recovered_blocks"] = len(found.key_to_header)
            return list(found.key_to_header.values())

    # -- the writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._changed:
                    while not self._queue and not self._is_stopping:
                        self._changed.wait()
                    if self._is_stopping:
                        self._drop_queue_locked()
                        return
                    write = self._queue.popleft()
                try:
                    with self._io_lock:
                        self._write(write)
                finally:
                    self._finish(write)
        except BaseException:
            with self._changed:
                self._is_writer_dead = True
                self._drop_queue_locked()
                self._changed.notify_all()
            logger.exception("disk tier %s: writer thread died; disk writes stopped", self._root)
            raise

    def _write(self, write: _Write) -> bool:
        """Write one block durably. Returns True when it is published (renamed into place)."""
        key = write.meta.key
        with self._lock:
            if write.is_cancelled:
                return False
            if self._outage is not None and self._clock() < self._outage.retry_at:
                self._drop_locked(key, "dropped_unavailable")
                return False
        try:
            data = self._codec.encode(write.meta, write.block)
        except (CodecError, PayloadError) as exc:
            with self._lock:
                self._stats.errors += 1
                self._drop_locked(key, "encode_errors")
            logger.error("disk tier %s: block cannot be encoded: %s", self._root, exc)
            return False
        path = self._layout.path_for(key)
        directory = os.path.dirname(path)
        temp: str | None = None
        is_renamed = False
        try:
            self._layout.ensure_shard_dir(directory)
            temp = write_temp(self._ops, directory, os.path.basename(path), data,
                              fsync=self._is_fsync)
            with self._lock:
                if write.is_cancelled:
                    self._unlink_quietly(temp)
                    return False
            self._ops.replace(temp, path)
            is_renamed = True
            if self._is_fsync:
                self._ops.fsync_dir(directory)
        except OSError as exc:
            with self._lock:
                if temp is not None and not is_renamed:
                    self._unlink_quietly(temp)
                if is_renamed and not write.is_cancelled:
                    # Renamed but its directory entry may not be durable: never publish it.
                    self._unlink_quietly(path)
                if exc.errno == errno.ENOENT:  # a directory vanished: create it again next time
                    self._layout.forget_known_dirs()
                self._stats.errors += 1
                self._drop_locked(key, "write_errors")
            self._on_write_error(exc)
            return False
        with self._lock:
            if write.is_cancelled:  # deleted while being renamed: the delete wins
                self._unlink_quietly(path)
                return False
            durable = _Durable(num_bytes=len(data))
            self._index[key] = durable
            self._num_index_bytes += durable.num_bytes
            self._counts["puts_written"] += 1
            outage, self._outage = self._outage, None
        if outage is not None:
            logger.info("disk tier %s: writes resumed (after %s)", self._root, outage.errno_name)
        return True

    def _finish(self, write: _Write) -> None:
        with self._changed:
            if self._pending.get(write.meta.key) is write:
                del self._pending[write.meta.key]
            self._pending_bytes -= write.nbytes
            self._num_outstanding -= 1
            self._changed.notify_all()

    def _on_write_error(self, exc: OSError) -> None:
        if exc.errno in UNAVAILABLE_ERRNOS:
            self._enter_outage(exc)
            return
        now = self._clock()
        with self._lock:
            should_log = (
                self._last_error_log_at is None
                or now - self._last_error_log_at >= self._retry_after_s
            )
            if should_log:
                self._last_error_log_at = now
        log = logger.warning if should_log else logger.debug
        log("disk tier %s: block write failed and was dropped: %s", self._root, _describe(exc))

    def _enter_outage(self, exc: OSError) -> None:
        """Stop writes until the retry time; one warning per outage (until a write succeeds)."""
        now = self._clock()
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        with self._lock:
            is_new = self._outage is None
            self._outage = _Outage(errno_name=name, retry_at=now + self._retry_after_s)
            if is_new:
                self._counts["unavailable_episodes"] += 1
        if is_new:
            logger.warning(
                "disk tier %s: writes stopped (%s); puts are dropped and reads continue; "
                "retrying in %.0f s",
                self._root,
                _describe(exc),
                self._retry_after_s,
            )
        else:
            logger.debug("disk tier %s: retry failed (%s)", self._root, name)

    def _probe_writable(self) -> None:
        """Create and remove a temp file in the root, so a read-only disk is known at once."""
        try:
            fd, path = self._ops.open_temp(self._root, ".probe")
            try:
                self._ops.close(fd)
            finally:
                self._ops.unlink(path)
        except OSError as exc:
            self._enter_outage(exc)

    # -- helpers -----------------------------------------------------------------------------

    def _drop_locked(self, key: BlockKey, counter: str) -> None:
        """Count why ``key`` did not reach the disk and report it through ``drain_failed``."""
        self._counts[counter] += 1
        self._failed.append(key)

    def _drop_queue_locked(self) -> None:
        while self._queue:
            write = self._queue.popleft()
            if self._pending.get(write.meta.key) is write:
                del self._pending[write.meta.key]
            self._pending_bytes -= write.nbytes
            self._num_outstanding -= 1
            if not write.is_cancelled:
                self._drop_locked(write.meta.key, "dropped_closed")
        self._changed.notify_all()

    def _forget_locked(self, key: BlockKey, durable: _Durable) -> None:
        if self._index.get(key) is durable:
            del self._index[key]
            self._num_index_bytes -= durable.num_bytes

    def _unlink_quietly(self, path: str) -> None:
        """Remove a file; a missing file is fine, other errors are counted (caller holds lock)."""
        try:
            self._ops.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._stats.errors += 1
            self._counts["unlink_errors"] += 1
            logger.debug("disk tier %s: cannot remove %s: %s", self._root, path, exc.strerror)


def _meta_mismatch(stored: BlockMeta, expected: BlockMeta) -> str | None:
    """The codec's reason word for a pending block whose identity differs from ``expected``."""
    if stored.namespace_digest != expected.namespace_digest:
        return "namespace"
    if stored.parent_key != expected.parent_key:
        return "parent"
    if stored.tokens != expected.tokens:
        return "tokens"
    return None


def _describe(exc: OSError) -> str:
    code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return f"{code}: {exc.strerror}" if exc.strerror else code
