"""Warm must equal cold: the start-up probe that the batched forward is invariant on these
weights here, the route search over candidate forwards and its remembered verdicts, shadow
verification of sampled hits, and the prefill and recompute speeds the cache judges loads by."""
