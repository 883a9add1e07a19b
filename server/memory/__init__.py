"""The daemon's memory: the pool arena, the client regions it maps, the copy
engines that move bytes between them, and the pool file's snapshot and lock.

Everything here touches the operating system (memfd, mmap, madvise, threads,
files); the pure logic that decides *what* to copy is kvdepot.server.core.
"""
