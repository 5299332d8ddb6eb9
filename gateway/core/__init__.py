"""Shared vocabulary of every layer: token blocks, canonical prompts, the tokenizer seam,
keyed block fingerprints, request records and the domain errors. Imports nothing above it."""
