"""The C library calls kvdepot makes through ctypes, with their prototypes declared
once (ctypes guesses int for every argument and result otherwise, which truncates
addresses). Linux only, like the rest of kvdepot."""

from __future__ import annotations

import ctypes

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
