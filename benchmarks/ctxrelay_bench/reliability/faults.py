"""Injected faults for the stores, and the audit that says whether a store survived them.

- `os_fault(stage, err)`: the disk store's write calls fail as a full (ENOSPC), read-only (EROFS)
  or failing (EIO) disk would: at creating the temporary file, half-way through writing it, at
  fsync, or at the rename into place.
- `kill_mid_write(root, ...)`: a forked writer process is SIGKILLed at a random moment while it
  writes states; what it acknowledged must still be there and verify.
- `race_same_key(root, ...)`: two processes write the same key while this one reads it.
- `audit(root)`: every entry of a disk store verifies (seal, checksum, key) or is absent.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

from ctxrelay import tensorfile
from ctxrelay.relay.store import DiskStore, StateKey, StoreUnavailable
from ctxrelay.state import Binding, ContextState, content_hash

STAGES = ("create", "write", "fsync", "replace")
ERRORS = {"disk_full": errno.ENOSPC, "read_only": errno.EROFS, "io_error": errno.EIO}


def make_state(text: str, tenant: str = "acme", tokens: int = 64, meta: dict | None = None) -> ContextState:
    g = torch.Generator().manual_seed(len(text) + tokens)
    return ContextState(
        text=text,
        tokens=torch.arange(tokens),
        offsets=torch.stack([torch.arange(tokens), torch.arange(tokens) + 1], 1),
        binding=Binding("m", "w" * 64, "t" * 64, tenant),
        keys_pre_rope=torch.randn(2, tokens, 2, 8, generator=g),
        values=torch.randn(2, tokens, 2, 8, generator=g),
        meta=meta or {},
    )


@dataclass
class Hits:
    n: int = 0  # faults raised


@contextmanager
def os_fault(stage: str, err: int) -> Iterator[Hits]:
    """Within the block, every tensorfile write fails at `stage` with OSError(err); counts the failures."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}")
    hits = Hits()

    def fail() -> OSError:
        hits.n += 1
        return OSError(err, os.strerror(err))

    def raise_(*a, **k):
        raise fail()

    real_save_file = tensorfile.save_file

    def half_written(tensors, filename, metadata=None):  # the first half of the bytes reach the file, then "full"
        real_save_file(tensors, filename, metadata=metadata)
        os.truncate(filename, os.path.getsize(filename) // 2)
        raise fail()

    patches = {
        "create": mock.patch.object(tensorfile.tempfile, "mkstemp", raise_),
        "write": mock.patch.object(tensorfile, "save_file", half_written),
        "fsync": mock.patch.object(tensorfile.os, "fsync", raise_),
        "replace": mock.patch.object(tensorfile.os, "replace", raise_),
    }
    with patches[stage]:
        yield hits


@dataclass
class Audit:
    entries: int = 0
    corrupt: int = 0
    debris: int = 0  # temporary files a killed writer left (never read as entries)

    def as_dict(self) -> dict:
        return vars(self).copy()


def audit(root: Path) -> Audit:
    """Read every entry of the disk store at `root` as its tenant would: each verifies or it is corrupt."""
    a = Audit()
    store = DiskStore(root, sweep_after_s=None)
    for tenant_dir in sorted(p for p in Path(root).glob("*") if p.is_dir()):
        a.debris += len(list(tenant_dir.glob(".*.tmp")))
        for key in store.keys(tenant_dir.name):
            a.entries += 1
            try:
                if store.get(key, key.tenant) is None:
                    a.corrupt += 1
            except StoreUnavailable:
                a.corrupt += 1
    return a


# ---- a writer process killed at random --------------------------------------------------------


def _fork(child) -> int:
    pid = os.fork()
    if pid == 0:  # the child never returns into the caller's code (nor its test runner)
        code = 1
        try:
            torch.set_num_threads(1)
            child()
            code = 0
        finally:
            os._exit(code)
    return pid


def _writer(root: Path, ack_fd: int, tokens: int, keys: int, seed: int) -> None:
    store = DiskStore(root, sweep_after_s=None)
    rng = random.Random(seed)
    i = 0
    while True:
        k = rng.randrange(keys)
        state = make_state(f"document {k}", tokens=tokens, meta={"version": i})
        store.put(state)
        os.write(ack_fd, f"{k} {i}\n".encode())  # acknowledged: written, synced and renamed
        i += 1


@dataclass
class KillReport:
    kills: int = 0
    mid_write: int = 0  # kills that landed inside a write
    acknowledged: int = 0  # writes the killed processes had confirmed
    lost: int = 0  # confirmed keys absent after a kill (the worst audit)
    corrupt: int = 0  # entries that did not verify (the worst audit)
    debris: int = 0
    entries: int = 0

    def as_dict(self) -> dict:
        return vars(self).copy()


def kill_mid_write(root: Path, kills: int = 20, tokens: int = 4096, keys: int = 4, seed: int = 0) -> KillReport:
    """SIGKILL a writer `kills` times at random moments; after each, audit the store."""
    rng = random.Random(seed)
    rep = KillReport()
    confirmed: set[int] = set()
    for n in range(kills):
        r, w = os.pipe()
        pid = _fork(lambda r=r, w=w, n=n: (os.close(r), _writer(root, w, tokens, keys, seed + n)))
        os.close(w)
        first = os.read(r, 64)  # wait for one finished write, then kill at a random point of the next ones
        time.sleep(rng.uniform(0.0, 0.15))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        acks = (first + _drain(r)).decode().split("\n")
        os.close(r)
        done = [line.split() for line in acks if len(line.split()) == 2]
        rep.acknowledged += len(done)
        confirmed |= {int(k) for k, _ in done}
        rep.kills += 1
        a = audit(root)
        rep.mid_write += a.debris > rep.debris  # the killed writer left its temporary: it died inside a write
        rep.debris = a.debris
        rep.corrupt = max(rep.corrupt, a.corrupt)
        present = {key.content_hash for key in DiskStore(root, sweep_after_s=None).keys("acme")}
        rep.lost = max(rep.lost, sum(1 for k in confirmed if content_hash(f"document {k}") not in present))
    a = audit(root)
    rep.debris, rep.entries = a.debris, a.entries
    return rep


def _drain(fd: int) -> bytes:
    out = b""
    while chunk := os.read(fd, 1 << 16):
        out += chunk
    return out


# ---- two writers, one key ----------------------------------------------------------------------


def race_same_key(root: Path, writes: int = 30, tokens: int = 512) -> dict:
    """Two processes overwrite one key `writes` times each while this process reads it back."""
    key = StateKey.of(make_state("the contended document", tokens=tokens))

    def writer(w: int) -> None:
        store = DiskStore(root, sweep_after_s=None)
        for i in range(writes):
            store.put(make_state("the contended document", tokens=tokens, meta={"writer": w, "i": i}))

    alive = {_fork(lambda w=w: writer(w)) for w in range(2)}
    reads = torn = failed_writers = 0
    seen: set[int] = set()
    reader = DiskStore(root, sweep_after_s=None)
    while alive:
        for pid in list(alive):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                alive.discard(pid)
                failed_writers += os.waitstatus_to_exitcode(status) != 0
        try:
            s = reader.get(key, key.tenant)
        except StoreUnavailable:
            torn += 1
            continue
        if s is not None:
            reads += 1
            seen.add(s.meta["writer"])
    final = reader.get(key, key.tenant)
    return {"writers": 2, "writes": 2 * writes, "failed_writers": failed_writers, "reads": reads, "torn_reads": torn,
            "writers_seen": len(seen),
            "final_verifies": final is not None, **audit(root).as_dict()}  # fmt: skip


def scratch_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"ctxrelay-{prefix}-"))
