"""wehub_ps.process.allocator: freed message-sized blocks are reused instead of faulted in again.

Each case runs in a fresh interpreter: the setting is process-wide, and
this test process has already changed it (every PSClient does).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from wehub_ps.process.allocator import DEFAULT_ARENA_MAX, keep_freed_buffers, keep_room_for_step

glibc_only = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="mallopt thresholds exist in glibc only")

# Four 1 MiB blocks allocated and freed 50 times, like a worker receiving
# chunk messages: glibc's own thresholds give the heap top back to the
# kernel after each round, so every round faults its pages in again.
_CHURN = textwrap.dedent("""
    import resource, sys
    from wehub_ps.process.allocator import keep_freed_buffers
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


# A training step: 21 arrays of 4 MiB (84 MiB, over the default trim threshold) allocated, written
# and freed together, 10 times. Without room kept for the step, the freed heap top goes back to the
# kernel after each round and the next round faults it in again.
_STEP_CHURN = textwrap.dedent("""
    import resource, sys
    from wehub_ps.process.allocator import WORKER_MMAP_THRESHOLD, keep_freed_buffers, keep_room_for_step
    assert keep_freed_buffers(mmap_threshold=WORKER_MMAP_THRESHOLD)
    if sys.argv[1] == "room":
        assert keep_room_for_step(21 * (4 << 20))
        assert not keep_room_for_step(4 << 20)  # only ever raised
        assert keep_freed_buffers(mmap_threshold=WORKER_MMAP_THRESHOLD)  # a second client keeps the room
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step = [bytearray(4 << 20) for _ in range(21)]
    del step
    before = faults()
    for _ in range(10):
        step = [bytearray(4 << 20) for _ in range(21)]
        del step
    print(faults() - before)
""")


@glibc_only
def test_room_kept_for_a_step_stops_its_memory_going_back_to_the_kernel_each_step():
    runs = {mode: int(subprocess.run([sys.executable, "-c", _STEP_CHURN, mode], capture_output=True, text=True,
                                     timeout=120, check=True).stdout.strip()) for mode in ("worker", "room")}
    # 10 rounds x 84 MiB / 4 KiB pages = 215,040 faults when the memory goes back each round.
    assert runs["worker"] > 100_000, f"only {runs['worker']} page faults without room: the test no longer tells"
    assert runs["room"] < runs["worker"] // 20, runs


def test_room_for_a_step_changes_nothing_where_freed_buffers_are_not_kept():
    done = subprocess.run([sys.executable, "-c", "from wehub_ps.process.allocator import keep_room_for_step;"
                           "print(keep_room_for_step(1 << 30))"], capture_output=True, text=True, timeout=60,
                          check=True)
    assert done.stdout.strip() == "False"


@glibc_only
def test_setting_twice_is_idempotent():
    assert keep_freed_buffers() and keep_freed_buffers()


@pytest.mark.parametrize("kwargs, words", [
    ({"mmap_threshold": 0}, ["mmap_threshold", "0"]),
    ({"mmap_threshold": 64 << 20}, ["mmap_threshold", str(64 << 20)]),
    ({"trim_threshold": -1}, ["trim_threshold", "-1"]),
    ({"arena_max": 0}, ["arena_max", "0"]),
])
def test_bad_thresholds_are_refused(kwargs, words):
    with pytest.raises(ValueError) as info:
        keep_freed_buffers(**kwargs)
    for word in words:
        assert word in str(info.value)


# Eight threads allocate outside the GIL (ctypes releases it), as gRPC's
# threads do: glibc gives a thread's first malloc a new arena while there
# are fewer than its limit (8 per core), and hands the arena of a thread
# that ended to the next one. The barrier keeps all eight alive, each with
# its arena, whatever the scheduler does on a busy machine. malloc_info
# lists one <heap> per arena.
_ARENAS = textwrap.dedent("""
    import ctypes, os, re, sys, tempfile, threading
    from wehub_ps.process.allocator import keep_freed_buffers
    if sys.argv[1] == "tuned":
        assert keep_freed_buffers()
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, (ctypes.c_char_p, ctypes.c_char_p)
    libc.malloc_info.argtypes, libc.fclose.argtypes = (ctypes.c_int, ctypes.c_void_p), (ctypes.c_void_p,)
    together = threading.Barrier(8)
    def churn():
        first = libc.malloc(256 << 10)
        together.wait()
        libc.free(first)
        for _ in range(3000):
            libc.free(libc.malloc(256 << 10))
    threads = [threading.Thread(target=churn) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "info.xml")
        out = libc.fopen(path.encode(), b"w")
        libc.malloc_info(0, out)
        libc.fclose(out)
        print(len(re.findall("<heap nr=", open(path).read())))
""")


def _arenas_after_threads(mode: str, environ: dict[str, str] | None = None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | (environ or {})
    done = subprocess.run([sys.executable, "-c", _ARENAS, mode], capture_output=True, text=True, timeout=60,
                          check=True, env=env)
    return int(done.stdout.strip())


@glibc_only
def test_arenas_are_capped_so_kept_memory_does_not_grow_with_threads():
    untuned = _arenas_after_threads("default")
    assert untuned > DEFAULT_ARENA_MAX, f"glibc made only {untuned} arenas: the test no longer tells"
    assert _arenas_after_threads("tuned") <= DEFAULT_ARENA_MAX


@glibc_only
def test_malloc_arena_max_in_the_environment_wins():
    assert _arenas_after_threads("tuned", {"MALLOC_ARENA_MAX": "3"}) == 3
