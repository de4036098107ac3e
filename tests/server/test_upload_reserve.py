"""Uploads at once keep out of the disk reserve together (#66, finding 6b): each claims its room before it writes
(what its request declares, else a few MiB at a time), and every upload's check counts what the others have
claimed and not yet written. Before, each checked the free space alone, per 4 MiB written, so eight uploads
that checked at once each took the same room and together wrote far into --disk-reserve-mb. The real service
(`python -m fusionrag serve`), its data directory on a small tmpfs where mounting is allowed, else on the real
disk with the reserve set just under its free space."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_util import ServerProcess

from fusionrag.retriever.collection import quota

MiB = 1 << 20
UPLOADS = 8
SIZE = 7 * MiB // 2  # each upload: under the 4 MiB the service checked at a time before
ROOM = 12 * MiB  # free above the reserve: three uploads fit, eight do not
CHUNK = 4 * MiB  # what the service claimed per check before; the most its uploads may pass the reserve by now


def _small_disk(path: Path, size_mb: int):
    """A tmpfs of size_mb where mounting is allowed (root, as CI runs), else None."""
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], capture_output=True)
    return path if r.returncode == 0 else None


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_concurrent_uploads_together_stay_out_of_the_disk_reserve(tmp_path, declared):
    """Eight restores of 3.5 MiB at once, with 12 MiB free above the reserve: each sends its first 64 KiB, waits
    until all eight have, then the rest but one byte, and waits again while the free space is measured. Those
    the room fits are written, the others refused with 507 (or their connection closed on them) before they
    write; the free space never falls below the reserve by more than one 4 MiB chunk (before: eight uploads of
    3.5 MiB, 16 MiB into it)."""
    disk = _small_disk(tmp_path / "disk", 128)
    root = disk or tmp_path / "disk"
    try:
        data = root / "data"
        data.mkdir()
        # The reserve: ROOM under the free space the service will leave once started (measured on a first start).
        srv = ServerProcess(data, tmp_path / "log0", "--no-demo")
        srv.wait_ready()
        srv.stop()
        reserve = quota.free_bytes(root) - ROOM
        srv = ServerProcess(data, tmp_path / "log", "--no-demo", "--disk-reserve-mb", f"{reserve / MiB:.6f}")
        try:
            srv.wait_ready()
            lowest = [quota.free_bytes(root)]
            stop = threading.Event()

            def watch():
                while not stop.is_set():
                    lowest[0] = min(lowest[0], quota.free_bytes(root))
                    time.sleep(0.01)

            started = [threading.Event() for _ in range(UPLOADS)]
            paused = [threading.Event() for _ in range(UPLOADS)]
            go, measured = threading.Event(), threading.Event()
            answers: list = []

            def body(i: int):
                yield b"x" * (64 << 10)
                started[i].set()
                assert go.wait(60)
                left = SIZE - (64 << 10) - 1
                while left:
                    n = min(left, 256 << 10)
                    yield b"x" * n
                    left -= n
                paused[i].set()
                assert measured.wait(60)
                yield b"x"

            def upload(i: int):
                headers = {"content-length": str(SIZE)} if declared else {}
                try:
                    with srv.client() as c:
                        r = c.post(f"/v1/collections/u{i}/restore", content=body(i), headers=headers)
                    answers.append((r.status_code, r.text[:200]))
                except httpx.HTTPError as e:  # refused, and the connection closed before the body was sent
                    answers.append(("closed", repr(e)))
                finally:  # a request that ended before its body did: neither starts nor pauses any more
                    started[i].set()
                    paused[i].set()

            watcher = threading.Thread(target=watch)
            watcher.start()
            threads = [threading.Thread(target=upload, args=(i,)) for i in range(UPLOADS)]
            for t in threads:
                t.start()
            for e in started:  # every upload has sent its first bytes (or ended)
                assert e.wait(60)
            time.sleep(1.0)  # and the service has taken them: checked, claimed or refused
            go.set()
            for e in paused:
                assert e.wait(60)
            time.sleep(1.0)
            at_pause = quota.free_bytes(root)
            measured.set()
            for t in threads:
                t.join(120)
            stop.set()
            watcher.join()
        finally:
            srv.stop()
        codes = sorted(str(a[0]) for a in answers)
        print("answers", codes, "reserve", reserve // MiB, "MiB, lowest free", lowest[0] // MiB, "MiB, at the pause",
              at_pause // MiB, "MiB")
        assert min(lowest[0], at_pause) >= reserve - CHUNK, (
            f"the uploads went {(reserve - min(lowest[0], at_pause)) / MiB:.1f} MiB into the reserve")
        assert len(answers) == UPLOADS
        # written whole, then refused as no snapshot (422); or refused for the room (507); never another 5xx
        assert all(a[0] in (422, 507, "closed") for a in answers), answers
        assert "507" in codes or "closed" in codes, answers  # eight do not fit
        assert codes.count("422") >= 2, answers  # and those that fit were written
        refused = [a for a in answers if a[0] == 507]
        assert all("reserve" in a[1] for a in refused), refused
    finally:
        if disk:
            subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_claim_counts_in_every_check_of_the_reserve_until_written_or_released(tmp_path):
    """quota.DiskClaim in process: what one writer has claimed and not written is counted by every check_room on
    the file system (and by another claim), given back as it is written and when released."""
    from fusionrag.retriever.errors import StorageError

    reserve = quota.free_bytes(tmp_path) - 100 * MiB  # 100 MiB above the reserve, give or take others' writes
    claim = quota.DiskClaim(tmp_path, reserve, "the upload")
    claim.take(60 * MiB)
    with pytest.raises(StorageError, match="claimed by uploads in progress"):
        quota.check_room(tmp_path, 60 * MiB, reserve, "the snapshot")
    with pytest.raises(StorageError, match="reserve"):
        quota.DiskClaim(tmp_path, reserve, "the upload").take(60 * MiB)
    quota.check_room(tmp_path, 20 * MiB, reserve, "the snapshot")
    claim.wrote(40 * MiB)  # as if written (the free space here did not fall: the claim alone is given back)
    assert claim.held == 20 * MiB
    quota.check_room(tmp_path, 60 * MiB, reserve, "the snapshot")
    with quota.DiskClaim(tmp_path, reserve, "the upload") as other:
        other.take(50 * MiB)
        with pytest.raises(StorageError):
            claim.take(40 * MiB)
    claim.release()
    assert claim.held == 0 and not quota._claimed
    quota.check_room(tmp_path, 90 * MiB, reserve, "the snapshot")
