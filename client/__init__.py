"""Client SDK (async and sync): submit jobs and drive interactive sessions.

Sessions run the tokenizer, embedding and output head locally and send hidden states along the
providers' route; batch jobs go through the broker. Wire and IR code come from `p2p`, `proto`
and `ir`, never reimplemented here.
"""
