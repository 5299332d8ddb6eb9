"""Preempting a running generation, and resuming it to the same answer (issue 28; docs/design.md,
"Priority lanes").

The scheduler decides who is preempted (``Scheduler.preemptions``: a tenant's worse-priority
requests, for its better-priority one that does not fit); this is what the step loop does to the
one it preempts, and what it resumes from.

Why the answer cannot change: a token's K/V and logits depend only on its own sequence's tokens
(the invariant forward, docs/design.md "Parity"), and decoding writes exactly the K/V a prefill of
the same tokens writes (probed at start-up: ``decode_kv_is_prefill_kv``; the scheduler preempts
nothing on a route where it does not hold). So a generation stopped after ``n`` answer tokens and
prefilled again over its prompt and those ``n`` tokens holds the same K/V and gets the same logits
for its next token, which its own sampler (the same random generator, where it samples) turns
into the token it would have sampled. The stream goes on where it stopped: the tokens already sent
are part of what is prefilled, never sampled or sent again.

Why it is cheap: its full pages are handed to the cache (they become cached blocks, as a finished
answer's do, and are demoted to the host tier like any block when the device tier is full), the
tokens after its last full block are kept as a conversation tail (where tails are kept), and its
own pages go back to the pool. Resumed, it is admitted as a hit on its own tokens and computes
again only its last token (its logits are needed) and whatever the cache no longer holds: blocks
evicted meanwhile, or everything for a request that asked ``no_cache``.
"""

from __future__ import annotations

import numpy as np

from gateway.core.tokens import TokenIds, as_token_ids
from gateway.engine.scheduling.loop_records import ActiveRequest
from gateway.engine.scheduling.request_blocks import RequestBlocks


def resume_tokens(active: ActiveRequest) -> TokenIds:
    """What a resumed generation is prefilled over: its prompt, then the tokens it generated."""
    if not active.generated:
        return active.job.tokens
    return as_token_ids(np.concatenate(
        [active.job.tokens, np.asarray(active.generated, dtype=np.uint32)]))


def suspend(active: ActiveRequest, blocks: RequestBlocks | None) -> None:
    """Hand ``active``'s complete K/V to the cache (None: no cache, it will be recomputed),
    then let go of its pages and its lease; its sampler, detokenizer and tokens stay in
    ``active`` for ``ActiveRequest.carry_on``.

    Raises:
        Exception: whatever storing raised; the caller ends the request (its pages and lease
            are released then).
    """
    if blocks is not None:
        blocks.store_for_resume(active)
    active.seq.release()
    active.stack.close()
