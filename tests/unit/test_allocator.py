"""wehub_ps.allocator: freed message-sized blocks are reused instead of faulted in again.

Each case runs in a fresh interpreter: the setting is process-wide, and
this test process has already changed it (every PSClient does).
"""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

from wehub_ps.allocator import keep_freed_buffers

glibc_only = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="mallopt thresholds exist in glibc only")

# Four 1 MiB blocks allocated and freed 50 times, like a worker receiving
# chunk messages: glibc's own thresholds give the heap top back to the
# kernel after each round, so every round faults its pages in again.
_CHURN = textwrap.dedent("""
    import resource, sys
    from wehub_ps.allocator import keep_freed_buffers
    if sys.argv[1] == "tuned":
        assert keep_freed_buffers()
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [bytearray(1 << 20) for _ in range(4)]
    del blocks
    before = faults()
    for _ in range(50):
        blocks = [bytearray(1 << 20) for _ in range(4)]
        del blocks
    print(faults() - before)
""")


def _page_faults_of_churn(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _CHURN, mode], capture_output=True, text=True, timeout=60,
                          check=True)
    return int(done.stdout.strip())


@glibc_only
def test_freed_blocks_are_reused_without_page_faults():
    untuned = _page_faults_of_churn("default")
    tuned = _page_faults_of_churn("tuned")
    # 50 rounds x 4 MiB / 4 KiB pages = 51,200 faults when the memory goes back each time.
    assert untuned > 10_000, f"glibc's defaults faulted only {untuned} pages: the test no longer tells"
    assert tuned < untuned // 20, f"tuned {tuned} page faults vs {untuned} with glibc's defaults"


@glibc_only
def test_setting_twice_is_idempotent():
    assert keep_freed_buffers() and keep_freed_buffers()


@pytest.mark.parametrize("kwargs, words", [
    ({"mmap_threshold": 0}, ["mmap_threshold", "0"]),
    ({"mmap_threshold": 64 << 20}, ["mmap_threshold", str(64 << 20)]),
    ({"trim_threshold": -1}, ["trim_threshold", "-1"]),
])
def test_bad_thresholds_are_refused(kwargs, words):
    with pytest.raises(ValueError) as info:
        keep_freed_buffers(**kwargs)
    for word in words:
        assert word in str(info.value)
