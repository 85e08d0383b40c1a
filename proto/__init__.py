"""Contracts between roles: one module per protocol, data only.

Each module defines frozen, versioned message types (`p2p.Message` subclasses) and the
`p2p.ProtocolSpec` that binds them to a protocol id `/fusionai/<name>/<version>` with its size
limit. No logic and no I/O live here.
"""
