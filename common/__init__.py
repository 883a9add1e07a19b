"""Code shared by the daemon and its clients: standard library only, so that
`kvdepot.client` (and a plain vLLM environment) can import it without the
daemon's dependencies."""
