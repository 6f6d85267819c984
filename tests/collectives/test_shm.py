"""The shared-memory payload path: a sender's write is what the receiver reads, and a receiver refuses any
descriptor that names something else than a pslab segment of that sender or reaches outside it."""

from __future__ import annotations

import os

import pytest
import torch

from pslab.collectives import shm
from pslab.collectives.errors import WireError

pytestmark = pytest.mark.skipif(not shm.available(), reason="/dev/shm not writable")


def test_write_then_view_round_trip_and_cleanup():
    """Bytes written by an Outbox come back through an Inbox view; the name is unlinked once mapped."""
    box = shm.Outbox("0123456789ab", src=3, dst=1)
    box.reserve(4096)
    t = torch.arange(10, dtype=torch.float32)
    desc = box.write(64, t)
    inbox = shm.Inbox()
    view = inbox.view(3, desc)
    assert torch.equal(view, t)
    assert not os.path.exists(os.path.join(shm.SHM_DIR, box.name))
    box.write(64, t * 2)  # same region, new data: the mapping is shared, not a copy
    assert torch.equal(inbox.view(3, desc), t * 2)
    box.close()


@pytest.mark.parametrize("desc, fragment", [
    (["../../etc/passwd", 10, 0, "float32", [1]], "not one rank 3 may use"),
    (["pslab-0123456789ab-4-1-1", 4096, 0, "float32", [1]], "not one rank 3 may use"),
    (["pslab-0123456789ab-4-3-1", 4096, 0, "float32", [1]], "not one rank 3 may use"),   # 3 is the destination
    (["pslab-0123456789ab-3-1-1", 4096, 4090, "float32", [4]], "outside"),
    (["pslab-0123456789ab-3-1-1", 4096, -8, "float32", [1]], "outside"),
    (["pslab-0123456789ab-3-1-1", 4096, 0, "float99", [1]], "wrong type"),
    (["pslab-0123456789ab-3-1-9", 4096, 0, "float32", [1]], "cannot be opened"),
    ("nonsense", "descriptor must be"),
])
def test_bad_descriptors_are_refused(desc, fragment):
    """Path tricks, another rank's segment, out-of-range offsets, bad dtypes and missing segments: WireError."""
    with pytest.raises(WireError, match=fragment):
        shm.Inbox().view(3, desc)


def test_a_full_dev_shm_is_an_oserror_not_a_sigbus(monkeypatch):
    """reserve() allocates the segment (posix_fallocate): when /dev/shm cannot hold it, the caller gets OSError and
    the outbox is left empty, instead of a sparse file that kills the first writer with SIGBUS."""
    import errno
    import os

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    def mine() -> set[str]:        # this job's entries only: other tests' processes come and go in /dev/shm meanwhile
        return {n for n in os.listdir(shm.SHM_DIR) if "0123456789ab" in n}
    before = mine()
    box = shm.Outbox("0123456789ab", 0, 1)
    with pytest.raises(OSError):
        box.reserve(1 << 20)
    assert box.size == 0 and box.name == "" and mine() == before

