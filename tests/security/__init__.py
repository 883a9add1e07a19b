"""Attacks on a real daemon (docs/security.md): each test runs an attack with real
processes and asserts that it fails with a clear status while the legitimate path
beside it still works."""
