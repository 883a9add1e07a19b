"""The C library calls kvdepot makes through ctypes, with their prototypes declared
once (ctypes guesses int for every argument and result otherwise, which truncates
addresses): mmap, munmap, madvise, memcmp, fallocate, prctl, clock_getcpuclockid, and
mbind through syscall.
Linux only, like the rest of kvdepot."""

from __future__ import annotations

import ctypes
import errno
import platform
from collections.abc import Iterable

#: madvise advice (Linux >= 5.14): maps pages writable, allocating what is missing,
#: without writing them.
MADV_POPULATE_WRITE = 23

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
libc.munmap.restype = ctypes.c_int
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.restype = ctypes.c_int
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.memcmp.restype = ctypes.c_int
libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]  # memory, bytes
# fallocate(2) itself, not posix_fallocate(3): where a file system cannot reserve
# space, glibc's posix_fallocate writes zeros over the whole range instead.
libc.fallocate.restype = ctypes.c_int
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]

# The CPU-time clock of another process (the bench reads a daemon's CPU time with it).
libc.clock_getcpuclockid.restype = ctypes.c_int
libc.clock_getcpuclockid.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]

# prctl(2) is variadic in glibc; its options take unsigned longs.
PR_SET_PDEATHSIG = 1
libc.prctl.restype = ctypes.c_int
libc.prctl.argtypes = [
    ctypes.c_int,
    ctypes.c_ulong,
    ctypes.c_ulong,
    ctypes.c_ulong,
    ctypes.c_ulong,
]


def set_parent_death_signal(signum: int) -> int:
    """Asks the kernel to send `signum` to this process when the thread that made it
    exits (PR_SET_PDEATHSIG): 0, or the errno."""
    if libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        return ctypes.get_errno()
    return 0


# mbind(2) has no glibc wrapper (libnuma has one; kvdepot does not depend on it): it is
# made through syscall(2), whose variadic arguments are passed with explicit C types.
MPOL_PREFERRED = 1
MPOL_BIND = 2
MPOL_INTERLEAVE = 3
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}.get(platform.machine())
_MASK_BITS = 1024  # nodes a mask can name (the kernel's MAX_NUMNODES is at most 1024)
libc.syscall.restype = ctypes.c_long


def mbind(address: int, length: int, mode: int, nodes: Iterable[int]) -> int:
    """Sets the memory policy of [address, address + length) over `nodes`: 0, or the
    errno (ENOSYS on an architecture whose call number is not listed here)."""
    if _SYS_MBIND is None:
        return errno.ENOSYS
    words = _MASK_BITS // (8 * ctypes.sizeof(ctypes.c_ulong))
    mask = (ctypes.c_ulong * words)()
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    for n in nodes:
        if not 0 <= n < _MASK_BITS:
            return errno.EINVAL
        mask[n // bits] |= 1 << (n % bits)
    rc = libc.syscall(
        ctypes.c_long(_SYS_MBIND),
        ctypes.c_void_p(address),
        ctypes.c_ulong(length),
        ctypes.c_int(mode),
        mask,
        ctypes.c_ulong(_MASK_BITS + 1),  # the kernel reads maxnode - 1 bits
        ctypes.c_uint(0),
    )
    return ctypes.get_errno() if rc != 0 else 0
