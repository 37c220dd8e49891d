"""The writer lock: one save at a time per location, since racing saves delete each other's files
(docs/format.md 7.1). Local: an ``fcntl.flock`` (dropped when its holder dies) on a file emptied on
release, so one found non-empty names a dead save. Object stores: an object created exclusively."""

from __future__ import annotations

import json
import os
import socket
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass

from gefen_ckpt.errors import CheckpointLockedError
from gefen_ckpt.io.storage import Store, open_regular

LOCK_NAME = ".gefen-ckpt.lock"
#: An object-store lock older than this is taken to belong to a save that died.
STALE_AFTER = 2 * 3600.0

try:
    import fcntl
except ImportError:  # pragma: no cover (Windows)
    fcntl = None


@dataclass
class WriterLock(AbstractContextManager):
    """A held lock. ``dead_token``: the token of a save that held it and died (or None)."""

    store: Store
    token: str
    dead_token: str | None = None
    _fd: int = -1  # the flock'd file (local), else -1
    _released: bool = False

    def release(self, clean: bool = True) -> None:
        """Drop the lock; ``clean=False`` (a failed save) leaves this save's token in a local lock
        file, as a save that died does, so the next save removes any file of it a stalled rank
        wrote after the survivors cleaned up."""
        if self._released:
            return
        self._released = True
        if self._fd >= 0:
            try:
                if clean:
                    os.ftruncate(self._fd, 0)
            finally:
                os.close(self._fd)  # closing drops the flock
            return
        if _token(_holder(self.store)) == self.token:
            self.store.remove(LOCK_NAME)

    def __exit__(self, *exc) -> None:
        self.release()


def _me(token: str) -> bytes:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "token": token,
                       "time": time.time()}).encode()


def _parse(data: bytes) -> dict | None:
    try:
        held = json.loads(data)
    except ValueError:
        return None
    return held if isinstance(held, dict) else None


def _token(held: dict | None) -> str | None:
    return held.get("token") if held and isinstance(held.get("token"), str) else None


def _holder(store: Store) -> dict | None:
    try:
        return _parse(store.read(LOCK_NAME))
    except FileNotFoundError:
        return None


def _describe(store: Store, held: dict | None) -> str:
    who = (f"pid {held.get('pid')} on {held.get('host')}, since "
           f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(held['time']))}"
           if held and isinstance(held.get("time"), (int, float)) else "another process")
    return (f"{store.url}: another save to this location is in progress ({who}); two saves to one location "
            f"would destroy each other's files, so this one was refused")


def acquire(store: Store, token: str) -> WriterLock:
    """Take the lock for a save with ``token``, or raise ``CheckpointLockedError`` naming the holder."""
    store.makedirs()
    if store.local and fcntl is not None:
        return _acquire_local(store, token)
    return _acquire_object(store, token)


def _acquire_local(store: Store, token: str) -> WriterLock:
    with store.storage_errors(LOCK_NAME):
        fd = open_regular(store.path(LOCK_NAME), os.O_RDWR | os.O_CREAT)  # never through a link
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointLockedError(_describe(store, _parse(os.pread(fd, 4096, 0)))) from None
        with store.storage_errors(LOCK_NAME):
            dead = _parse(os.pread(fd, 4096, 0))
            os.ftruncate(fd, 0)
            os.pwrite(fd, _me(token), 0)
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    return WriterLock(store, token, _token(dead), fd)


def _stale(held: dict | None) -> bool:
    if held is None:
        return True  # unreadable: not a lock this code wrote completely
    when, pid = held.get("time"), held.get("pid")
    if not isinstance(when, (int, float)) or time.time() - when > STALE_AFTER:
        return True
    if held.get("host") == socket.gethostname() and isinstance(pid, int):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
    return False


def _acquire_object(store: Store, token: str) -> WriterLock:
    dead_token = None
    for _ in range(3):
        try:
            store.create_exclusive(LOCK_NAME, _me(token))
        except FileExistsError:
            held = _holder(store)
            if held is None:
                time.sleep(0.2)  # written this instant, or removed: look again
                held = _holder(store)
            if not _stale(held):
                raise CheckpointLockedError(_describe(store, held)) from None
            dead_token = _token(held)
            store.remove(LOCK_NAME)
            continue
        held = _holder(store)  # a check-then-write backend: the last writer wins, the others see it
        if _token(held) != token:
            raise CheckpointLockedError(_describe(store, held))
        return WriterLock(store, token, dead_token)
    raise CheckpointLockedError(_describe(store, _holder(store)))
