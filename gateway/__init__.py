"""`fusionai gateway --broker URL`: the OpenAI-style endpoints as a stateless process.

Any number of gateways can run behind a load balancer. Each runs, for its HTTP users, what the
broker would run for them in a one-machine setup (the tokenizer, the embedding stage, the head
and sampling, batched across its sessions: `broker.gateway`), and asks the broker only for
decisions: which providers serve a stage, what an API key may do, and a lease per request
under the key's and the model's limits (`gateway.remote`). It reports its leases and traffic
to the broker every few seconds (`gateway.server`).
"""
