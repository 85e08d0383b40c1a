"""The home-internet lab: network namespaces on this machine standing for the Internet, a
broker host with a public address, and homes behind real NAT routers (port-restricted cone,
symmetric, and one with a UPnP IGD), their access links shaped in bandwidth (`tc tbf`) and
one-way latency (a userspace link, `lab.link`). For tests, benchmarks and the simulator's
comparisons; not shipped with the provider. Needs root, iproute2 and iptables
(`lab.net.missing()` says what is missing); `python -m lab up|run|down|status` drives it.

It stays inside the namespaces it creates (named `fl<run>-<role>`), uses documentation
addresses for its Internet (203.0.113.0/24), and never touches this machine's own
interfaces, routes or firewall (`lab.net.host_state()` is what a test compares)."""
