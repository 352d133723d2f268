"""The daemon's malloc tuning (``memory.tune_malloc``): a large block freed and allocated again
stays a mapping of its own instead of landing in the heap, where it would leave a hole."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PROBE = r"""
import ctypes, sys
from warmspec import memory
class Info(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
tuned = memory.tune_malloc() if sys.argv[1] == "tune" else False
before = libc.mallinfo2().arena
p = libc.malloc(16 << 20)
libc.free(p)  # a mapping, unmapped; untuned, glibc raises its threshold to 16 MiB
p = libc.malloc(16 << 20)  # untuned: from the heap now
print(int(tuned), (libc.mallinfo2().arena - before) >> 20)
"""


def probe(mode: str) -> tuple[bool, int]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT / 'daemon'}:{ROOT / 'protocol'}"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env,
                         check=True, timeout=60).stdout.split()
    return bool(int(out[0])), int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_large_block_does_not_move_into_the_heap():
    tuned, grew = probe("tune")
    assert tuned and grew == 0
    untuned, grew = probe("plain")  # the default glibc behaviour this guards against
    assert not untuned and grew >= 16
