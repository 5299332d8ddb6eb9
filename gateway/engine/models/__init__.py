"""A checkpoint read into what the engine runs: its weights as the modules the batched forward
walks, its tokenizer, and what the cache needs to know of it (transformers only behind
``transformers_api``)."""
