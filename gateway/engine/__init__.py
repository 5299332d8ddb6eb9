"""Who runs the model: the scheduler and step loop, the model loader (transformers only behind
``transformers_api``, imported where still needed), request KV buffers, sampling and
detokenization."""
