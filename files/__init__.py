"""Local files every role keeps: writes that a crash never leaves half done (`files.atomic`)
and the content-addressed artifact cache (`files.cache`: files named by their SHA-256, verified
before use) that the broker, providers and clients share. A leaf: it imports nothing of the
project, and does no network I/O beyond the downloads a caller asks the cache for.
"""
