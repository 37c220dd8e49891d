"""The one place that touches files (docs/design.md 7): a ``Store`` is one checkpoint directory on
any fsspec filesystem, a ``LocalStore`` (direct system calls) one on a local disk."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

import fsspec.core
from fsspec.implementations.local import LocalFileSystem

from gefen_ckpt.errors import CheckpointError, CheckpointFormatError, CheckpointStorageError
from gefen_ckpt.io import iostats, native

WRITE_BUFFER = 2**20
WRITE_CHUNK = 2 * 2**20
WRITEBACK_EVERY = 2 * 2**20
READ_CHUNK = 2**20
#: How far ``Prefetch`` may run ahead of its reader (page cache, not this process's memory).
PREFETCH_LEAD = 256 * 2**20
PREFETCH_CHUNK = 2 * 2**20


def _size(entry: os.DirEntry) -> int | None:
    """A plain file's size; None for anything else, and for an entry deleted while listed."""
    try:
        return entry.stat().st_size if entry.is_file(follow_symlinks=False) else None
    except FileNotFoundError:
        return None


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
_LINK = "a symbolic link; the files of a checkpoint must be regular files (links are not followed)"


def _refuse_kind(where: str, mode: int, directory_ok: bool = False) -> None:
    kind = next((what for test, what in _KINDS if test(mode)), None)
    if kind is not None and not (directory_ok and kind == "a directory"):
        raise CheckpointFormatError(f"{where}: not a regular file ({kind})")


def open_regular(path: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """``os.open`` of a file inside a checkpoint, which must be a regular file: a symbolic link is
    not followed (one policy for every path that opens one: a link could point anywhere, e.g. make a
    save write through a lock into another file) and a FIFO or device never blocks the open
    (``O_NONBLOCK``; blocking reads again once it is known to be regular). Anything else is a
    ``CheckpointFormatError`` naming the path."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointFormatError(f"{path}: {_LINK}") from None
        if exc.errno == errno.ENXIO:  # a FIFO opened for writing with no reader
            raise CheckpointFormatError(f"{path}: not a regular file (a FIFO or socket)") from None
        raise
    try:
        _refuse_kind(path, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def require_regular(fs, path: str, url: str) -> None:
    """Before a tool opens a local file it was given (a torch file, a names file): refuse a FIFO or
    device, which would block the open or the read forever (the user's own links are followed)."""
    if not isinstance(fs, LocalFileSystem):
        return
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # the open reports it
    _refuse_kind(url, mode, directory_ok=True)


def require_regular_entries(fs, root: str, url: str) -> None:
    """Every file directly in a local checkpoint directory opened by another library (DCP's
    reader) is a regular file: ``open_regular``'s policy where gefen_ckpt does not do the open."""
    if not isinstance(fs, LocalFileSystem):
        return
    try:
        with os.scandir(root) as entries:
            for entry in entries:
                if entry.is_symlink():
                    raise CheckpointFormatError(f"{url}/{entry.name}: {_LINK}")
                _refuse_kind(f"{url}/{entry.name}", entry.stat(follow_symlinks=False).st_mode, directory_ok=True)
    except (FileNotFoundError, NotADirectoryError):
        return


def _describe(exc: BaseException) -> str:
    """One line about a storage failure: the OS's words, or the backend's exception type and text."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _fsync(path: str, sync: Callable[[int], object] = os.fsync) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        sync(fd)
    finally:
        os.close(fd)


def _in_thread(work: Callable[[], None], name: str) -> Callable[[], None]:
    """Run ``work`` on a daemon thread; the returned callable joins it and re-raises its OSError."""
    errors: list[OSError] = []

    def run() -> None:
        try:
            work()
        except OSError as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()

    def wait() -> None:
        thread.join()
        if errors:
            raise errors[0]

    return wait


def _libc():
    """The C library when it has ``syncfs`` (Linux), else None."""
    if not hasattr(os, "sched_getaffinity"):  # not Linux
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syncfs.argtypes = [ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


class Prefetch:
    """Files read into the page cache, in order, for a reader that follows (``wait``), so a load's
    disk reads overlap its manifest validation and checksumming: ``sendfile`` to ``/dev/null``
    (2.6 GB/s cold, against 1.8 for ``pread``s, docs/decisions.md), at most ``lead`` bytes ahead
    of the reader (a checkpoint larger than memory does not evict its own first files). Errors
    end a file quietly: the reader reports them. The C library's loop needs no GIL between reads."""

    def __init__(self, files: list[tuple[str, int]], lead: int = PREFETCH_LEAD):
        self._files, self._lead, self._base, position = files, lead, {}, 0
        for path, size in files:
            self._base[path] = position
            position += size
        self._cv = threading.Condition()
        self._cached = self._wanted = 0  # positions in the files laid end to end
        self._stopped = False
        self._native = native.prefetch_start(files, PREFETCH_CHUNK, lead) if native.io else None
        if self._native is not None:
            weakref.finalize(self, native.prefetch_free, self._native, os.getpid())
        else:
            threading.Thread(target=self._run, name="gefen-ckpt-prefetch", daemon=True).start()

    @property
    def cached(self) -> int:
        """Bytes read so far (or given up on), counting the files end to end."""
        if self._native is not None:
            return native.prefetch_wait(self._native, 0)
        with self._cv:
            return self._cached

    def wait(self, path: str, end: int) -> None:
        """Return once ``path`` is cached up to byte ``end`` (or its prefetch has given up)."""
        base = self._base.get(path)
        if base is None:
            return
        if self._native is not None:
            native.prefetch_wait(self._native, base + end)
            return
        with self._cv:
            self._wanted = max(self._wanted, base + end)
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._stopped or self._cached >= base + end)

    def stop(self) -> None:
        if self._native is not None:
            native.prefetch_stop(self._native)
            return
        with self._cv:
            self._stopped = True
            self._cv.notify_all()

    def _run(self) -> None:
        """The loop without the C library, on a Python thread."""
        try:
            with suppress(OSError), open(os.devnull, "wb") as sink:
                for path, size in self._files:
                    base = self._base[path]
                    with suppress(OSError), open(path, "rb") as f:
                        offset = 0
                        while offset < size:
                            with self._cv:
                                self._cv.wait_for(lambda at=base + offset: self._stopped or at < self._wanted + self._lead)
                                if self._stopped:
                                    return
                            n = os.sendfile(sink.fileno(), f.fileno(), offset, min(PREFETCH_CHUNK, size - offset))
                            if n <= 0:
                                break
                            offset += n
                            self._advance(base + offset)
                    self._advance(base + size)
        finally:
            self.stop()

    def _advance(self, position: int) -> None:
        with self._cv:
            self._cached = max(self._cached, position)
            self._cv.notify_all()


class RangeReader:
    """``read_into(offset, buffer)`` fills ``buffer`` from ``offset`` and returns the bytes read
    (fewer only at end of file)."""

    def close(self) -> None:
        pass


class LocalReader(RangeReader):
    def __init__(self, fs, path: str):
        self.fd = open_regular(path)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def read_into(self, offset: int, buffer: memoryview) -> int:
        """In ``READ_CHUNK`` requests: ~1.8x faster cold than one large read, which defeats the
        kernel's asynchronous readahead."""
        done, total = 0, len(buffer)
        while done < total:
            n = os.preadv(self.fd, [buffer[done:done + READ_CHUNK]], offset + done)
            if n == 0:
                break
            done += n
        iostats.count(bytes_read=done, requests=1)
        return done

    def map_private(self) -> mmap.mmap:
        """The whole file mapped copy-on-write: reads come from the page cache without a copy,
        writes stay in this process. Valid after the file is replaced or deleted (the mapping
        keeps its inode); only an in-place truncation by another process would break it."""
        return mmap.mmap(self.fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)

    def close(self) -> None:
        os.close(self.fd)


class RemoteReader(RangeReader):
    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path

    def read_into(self, offset: int, buffer: memoryview) -> int:
        data = self.fs.cat_file(self.path, start=offset, end=offset + len(buffer))
        buffer[: len(data)] = data
        iostats.count(bytes_read=len(data), requests=1)
        return len(data)


class Writer:
    """``write(data)`` appends; ``close(durable)`` completes the file; ``abort()`` removes it."""

    def write_hashed(self, spans: list[tuple[int, int]]) -> list[int]:
        """Append the memory at each ``(address, size)`` (kept valid by the caller until this
        returns) and return the checksum of each span."""
        crcs = []
        for address, size in spans:
            data = (ctypes.c_ubyte * size).from_address(address) if size else b""
            self.write(data)  # counts
            crcs.append(native.crc32(0, data))
        return crcs


class LocalWriter(Writer):
    """Small writes are coalesced; every ``WRITEBACK_EVERY`` bytes the kernel is asked to start
    writing out (``posix_fadvise(DONTNEED)``), so the final fsync has little left and written pages
    leave the page cache instead of the training job's. With ``native.io``, ``write_hashed`` writes,
    hashes and starts writeback in one C call: no GIL between the system calls."""

    def __init__(self, fs, path: str):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.batch = bytearray()
        self.progress = [0, 0]  # bytes written, bytes handed to writeback

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        iostats.count(bytes_written=len(view))
        if len(view) < WRITE_BUFFER:
            self.batch += view
            if len(self.batch) >= WRITE_BUFFER:
                self._flush_batch()
            return
        self._flush_batch()
        self._write_out(view)

    def write_hashed(self, spans: list[tuple[int, int]]) -> list[int]:
        if not native.io:
            return super().write_hashed(spans)
        self._flush_batch()
        iostats.count(bytes_written=sum(size for _, size in spans))
        return native.write_hashed(self.fd, spans, WRITE_CHUNK, WRITEBACK_EVERY, self.progress)

    def _flush_batch(self) -> None:
        if self.batch:
            self._write_out(memoryview(self.batch))
            self.batch = bytearray()

    def _write_out(self, view: memoryview) -> None:
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
            self.progress[0] += n
        if self.progress[0] - self.progress[1] >= WRITEBACK_EVERY:
            self._start_writeback()

    def _start_writeback(self) -> None:
        written, flushed = self.progress
        if hasattr(os, "posix_fadvise") and written > flushed:
            os.posix_fadvise(self.fd, flushed, written - flushed, os.POSIX_FADV_DONTNEED)
            self.progress[1] = written

    def close(self, durable: bool = True) -> None:
        try:
            self._flush_batch()
            self._start_writeback()  # the tail too: a later fsync then finds the disk already busy
            if durable:
                os.fsync(self.fd)
        finally:
            self._close_fd()

    def abort(self) -> None:
        """Close and remove the file (also after a failed ``close``)."""
        try:
            self._close_fd()
        finally:
            with suppress(OSError):
                os.unlink(self.path)

    def _close_fd(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


class RemoteWriter(Writer):
    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path
        self.file = fs.open(path, "wb")

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        iostats.count(bytes_written=len(view))
        self.file.write(view)

    def close(self, durable: bool = True) -> None:
        self.file.close()  # an object store publishes the object, complete, on close

    def abort(self) -> None:
        discard = getattr(self.file, "discard", None)  # fsspec buffered files: drop the upload
        if discard is not None:
            discard()
        with suppress(OSError):
            self.fs.rm_file(self.path)


class Store:
    """A checkpoint directory over fsspec: whole-object writes (which object stores publish
    atomically on close), range reads, listing, publishing, deleting; ``Store(url)`` of a local
    path is a ``LocalStore``. Failures of the storage itself are ``CheckpointStorageError`` naming
    the path; a missing file stays ``FileNotFoundError``."""

    local = False  # files this process can map and lock (reader.py, writelock.py)
    _Reader, _Writer = RemoteReader, RemoteWriter

    @property
    def networked(self) -> bool:
        """Does every read cross a network (an object store; a network file system mounted
        locally)? Then ranks sharing rows read them once (``load(read_once=None)``)."""
        return True

    def __new__(cls, url: str | None = None, storage_options: dict | None = None):
        if url is None:  # copy/pickle: the attributes follow
            return super().__new__(cls)
        url = str(url)
        try:
            fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except Exception as exc:  # unknown protocol, missing backend package, bad options
            raise CheckpointStorageError(f"{url}: {_describe(exc)}") from exc
        if cls is Store and isinstance(fs, LocalFileSystem):
            cls = LocalStore
        self = super().__new__(cls)
        self.url, self.fs, self.root = url, fs, root.rstrip("/") or "/"
        return self

    @contextmanager
    def storage_errors(self, name: str | None = None) -> Iterator[None]:
        """Storage failures in the block (an ``OSError``, or a backend's own exception: botocore's,
        aiohttp's) become ``CheckpointStorageError`` naming the path; missing or existing files,
        ``CheckpointError`` and builtin exceptions of the caller's code pass through."""
        try:
            yield
        except (FileNotFoundError, FileExistsError, NotADirectoryError, CheckpointError):
            raise
        except Exception as exc:
            if not isinstance(exc, OSError) and (self.local or type(exc).__module__ == "builtins"):
                raise
            where = self.path(name) if name else self.url
            error = CheckpointStorageError(f"{where}: {_describe(exc)}")
            error.errno = getattr(exc, "errno", None)  # e.g. ENOSPC, for callers that act on it
            raise error from exc

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def makedirs(self) -> None:
        require_bucket(self.fs, self.root)
        self.fs.makedirs(self.root, exist_ok=True)

    @contextmanager
    def reader(self, name: str) -> Iterator[RangeReader]:
        with self.storage_errors(name):
            handle = self._Reader(self.fs, self.path(name))
        iostats.count(files_opened=1)
        try:
            with self.storage_errors(name):
                yield handle
        finally:
            handle.close()

    @contextmanager
    def create(self, name: str, durable: bool = True) -> Iterator[Writer]:
        """A new file, complete (with ``durable``, fsync'd; else ``durable_soon`` it) when the block
        exits without error. On error the partial file is removed; after a crash it is garbage no
        manifest references."""
        with self.storage_errors(name):
            writer = self._Writer(self.fs, self.path(name))
        iostats.count(files_opened=1, requests=1)
        try:
            with self.storage_errors(name):
                yield writer
                writer.close(durable)  # may raise too
        except BaseException:
            writer.abort()
            raise

    def refuse_special(self, name: str) -> None:
        """For a name the listing lacks (it lists regular files only): a link, FIFO or device there
        raises ``CheckpointFormatError``, refused as such rather than reported missing."""
        with suppress(FileNotFoundError):
            self.read(name, 0, 0)

    def remove(self, name: str) -> None:
        with suppress(FileNotFoundError), self.storage_errors(name):
            self.fs.rm_file(self.path(name))

    def prefetch(self, files: dict[str, int]) -> Prefetch | None:
        """Start reading files (name -> size) into the page cache (None: there is none)."""

    def durable_soon(self, name: str) -> Callable[[], None]:
        """Start making ``name`` (created with ``durable=False``) durable; the returned callable
        waits for it and raises ``OSError`` if it failed. An object is complete on close."""
        return lambda: None

    def sync(self) -> None:
        """Make the directory's entries durable (object stores have no directories)."""

    def write_files(self, files: list[tuple[str, memoryview]]) -> None:
        """Create each new file ``name`` holding ``data`` (not yet durable: ``durable_many``), for
        a writer of thousands of small files; a file that fails is removed."""
        for name, data in files:
            with self.create(name, durable=False) as out:
                out.write(data)

    def durable_many(self, names: list[str]) -> Callable[[], None]:
        """``durable_soon`` for many files at once; the returned callable waits for all of them."""
        waits = [self.durable_soon(name) for name in names]

        def wait() -> None:
            for w in waits:
                w()

        return wait

    # -- the generic (fsspec) way; LocalStore overrides each ----------------------------------------
    def listing(self) -> dict[str, int]:
        """name -> size of every plain file directly in the directory ({} if it does not exist)."""
        try:
            with self.storage_errors():
                self.fs.invalidate_cache(self.root)
                entries = self.fs.ls(self.root, detail=True)
            iostats.count(requests=1)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
                for e in entries if e.get("type") == "file"}

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of a file (to its end when ``end`` is None)."""
        with self.storage_errors(name):
            data = self.fs.cat_file(self.path(name), start=start, end=end)
        iostats.count(bytes_read=len(data), requests=1, files_opened=1)
        return data

    def publish(self, name: str, data: bytes, temp_name: str) -> None:
        """Replace ``name`` with ``data`` atomically and durably: readers see the old file or the
        new one (an object PUT is atomic)."""
        with self.storage_errors(name):
            self.fs.pipe_file(self.path(name), data)
        iostats.count(bytes_written=len(data), requests=1, files_opened=1)

    def create_exclusive(self, name: str, data: bytes) -> None:
        """Create ``name`` holding ``data``, or raise ``FileExistsError`` if it exists. Atomic on
        object stores whose fsspec backend implements ``pipe_file(mode="create")`` as a conditional
        write (s3fs: ``If-None-Match``); elsewhere fsspec checks, then writes (docs/format.md:
        writer lock)."""
        with self.storage_errors(name):
            self.fs.pipe_file(self.path(name), data, mode="create")
        iostats.count(bytes_written=len(data), requests=1, files_opened=1)


class LocalStore(Store):
    """A local directory: ``os.pwrite``/``os.preadv``, ``fsync`` and an atomic ``os.replace``,
    because that is what reaches disk speed and what makes a rename durable."""

    local = True
    _Reader, _Writer = LocalReader, LocalWriter

    @property
    def networked(self) -> bool:
        kind = filesystem_type(self.root)
        return kind in NETWORK_FILESYSTEMS or kind.startswith("fuse.")

    def listing(self) -> dict[str, int]:
        try:
            with self.storage_errors(), os.scandir(self.root) as it:
                return {e.name: size for e in it if (size := _size(e)) is not None}
        except (FileNotFoundError, NotADirectoryError):
            return {}

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        with self.storage_errors(name), open(open_regular(self.path(name)), "rb") as f:
            f.seek(start)
            data = f.read(-1 if end is None else end - start)
        iostats.count(bytes_read=len(data), requests=1, files_opened=1)
        return data

    def prefetch(self, files: dict[str, int]) -> Prefetch | None:
        if not hasattr(os, "sendfile"):
            return None
        return Prefetch([(self.path(name), size) for name, size in files.items()])

    def durable_soon(self, name: str) -> Callable[[], None]:
        """The fsync runs on a C thread (``gefen_ckpt.io.native``): a Python thread would need the
        GIL between its system calls, which the caller holds while it builds the manifest
        (docs/decisions.md)."""
        path = self.path(name)
        return (native.fsync_start(path) if native.io else None) or _in_thread(lambda: _fsync(path), "gefen-ckpt-fsync")

    def sync(self) -> None:
        _fsync(self.root)

    def write_files(self, files: list[tuple[str, memoryview]]) -> None:
        """One ``open``/``write``/``close`` per file (no write-back hints: the files are small and
        ``durable_many`` syncs them together)."""
        for name, data in files:
            path = self.path(name)
            with self.storage_errors(name):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    view = memoryview(data).cast("B")
                    iostats.count(bytes_written=len(view), files_opened=1, requests=1)
                    while view:
                        view = view[os.write(fd, view):]
                except BaseException:
                    os.close(fd)
                    with suppress(OSError):
                        os.unlink(path)
                    raise
                os.close(fd)

    def durable_many(self, names: list[str]) -> Callable[[], None]:
        """One ``syncfs`` (Linux) on a helper thread: thousands of fsyncs cost ~7 ms each, ``syncfs``
        writes the file system's dirty pages in one pass (and reports any file's write-back error
        since the call, Linux 5.8+). Elsewhere each file's ``durable_soon``."""
        libc = _libc()
        if libc is None or not names:
            return super().durable_many(names)

        def syncfs(fd: int) -> None:
            if libc.syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), self.root)

        return _in_thread(lambda: _fsync(self.root, syncfs), "gefen-ckpt-syncfs")

    def publish(self, name: str, data: bytes, temp_name: str) -> None:
        """The directory is synced before the rename too, so the entries of every file written
        before (data files) are durable before the new file can name them."""
        with self.create(temp_name) as w:
            w.write(data)
        try:
            with self.storage_errors(name):
                self.sync()
                os.replace(self.path(temp_name), self.path(name))
        except BaseException:
            self.remove(temp_name)
            raise
        with self.storage_errors(name):
            self.sync()

    def create_exclusive(self, name: str, data: bytes) -> None:  # atomic: ``LocalWriter`` opens with O_EXCL
        with self.create(name) as out:
            out.write(data)


#: Mounted file systems whose reads cross a network (``/proc/self/mountinfo`` names; FUSE mounts,
#: ``fuse.*``, too: s3fs, gcsfuse, blobfuse...).
NETWORK_FILESYSTEMS = frozenset({"nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "beegfs", "ceph",
                                 "glusterfs", "9p", "wekafs", "panfs", "pvfs2", "orangefs", "afs", "virtiofs"})


def filesystem_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str:
    """The type of the file system holding ``path`` (Linux: the longest mount point above it in
    ``mountinfo``); "" where that cannot be told."""
    try:
        with open(mountinfo) as f:
            mounts = [line.split() for line in f]
    except OSError:
        return ""
    path, best, kind = os.path.realpath(path if os.path.exists(path) else os.path.dirname(path) or "."), "", ""
    for fields in mounts:
        if "-" not in fields:
            continue
        point = fields[4].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[fields.index("-") + 1]
    return kind


#: Opt-in to creating a missing bucket (``gefen-ckpt convert/reshard --create-bucket`` sets it).
CREATE_BUCKET_ENV = "GEFEN_CKPT_CREATE_BUCKET"


def require_bucket(fs, root: str) -> None:
    """On an object store (a filesystem that splits paths into bucket and key), refuse to save
    into a bucket that does not exist: ``makedirs`` would silently create it, with the account's
    default region and policy, when the usual cause is a typo. ``$GEFEN_CKPT_CREATE_BUCKET=1``
    opts in to creating it."""
    split = getattr(fs, "split_path", None)
    if split is None or os.environ.get(CREATE_BUCKET_ENV, "").strip() not in ("", "0"):
        return
    bucket = split(root)[0]
    if bucket and not fs.exists(bucket):
        raise CheckpointError(f"bucket {bucket!r} does not exist ({root}): create it first, or set "
                              f"{CREATE_BUCKET_ENV}=1 (gefen-ckpt: --create-bucket) to let the save create it")
