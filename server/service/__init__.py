"""The gRPC services (Depot, Admin) over kvdepot.server.state, the error-to-status
mapping (status.py) and the tolerant message decoding (wire.py)."""
