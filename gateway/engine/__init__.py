"""Who runs the model: the scheduler and step loop, the model adapter (the only importer of
transformers), request KV buffers, sampling and detokenization."""
