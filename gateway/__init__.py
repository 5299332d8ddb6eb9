"""kvgate's service: canonical tokens, block fingerprints, the radix index and the request path."""
