"""The `fusionai` command: one subcommand group per package, each imported only when run.

Also owns the demo that starts a local swarm. Logic that belongs to a package stays there.
"""
