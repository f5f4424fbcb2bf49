"""A real, small filesystem that can run full: ``small_disk`` mounts a 4 MiB tmpfs for one test.

Why a tmpfs: a full disk must be the real thing (ENOSPC from write(2), mid-file) for the writer's
temp-file cleanup and retry logic to be tested; read-only directories do not stop root and
RLIMIT_FSIZE also hits the proxy's own log. Needs root (or CAP_SYS_ADMIN); skips otherwise.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


class SmallDisk:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.filler = path / "filler.bin"

    def fill(self) -> int:
        """Take every free byte (returns how many); the disk then answers ENOSPC."""
        n = 0
        with open(self.filler, "ab", buffering=0) as fh:
            for size in (65536, 4096, 512, 1):
                block = b"\0" * size
                while True:
                    try:
                        written = fh.write(block)
                    except OSError:
                        break
                    n += written or 0
                    if not written:
                        break
        return n

    def free(self) -> None:
        """Space returns."""
        self.filler.unlink(missing_ok=True)

    def temp_files(self) -> list[Path]:
        return [p for p in self.path.rglob(".*.tmp")]


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield SmallDisk(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
