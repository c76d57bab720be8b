"""Speculative decoding: the n-gram and MTP drafters, verification of every request's drafts in the
step's one forward, and the exact rollback of GDN state and KV after a rejected draft."""
