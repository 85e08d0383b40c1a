"""The provider daemon that runs on a contributor's machine.

Owns hardware profiling, joining a broker, the artifact cache, hosting and executing stages,
per-session KV caches, heartbeats and graceful drain. It makes no scheduling decisions.
"""
