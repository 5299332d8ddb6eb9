"""The recurrent layers of hybrid models, computed so that a cached prefix's state is exact.

See docs/families.md, "Hybrid models": each sequence's recurrent state is advanced in chunks
aligned to its own positions, so the state at a block's end has the same bits however the
tokens before it arrived (one prompt, many steps, one token at a time) and whatever ran beside
them.
"""
