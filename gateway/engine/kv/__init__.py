"""A request's KV: a block table over the shared page pool (``sequence``), a step's K/V written
into its pages (``step_writes``), and the K/V of conversation tails (``tail_cache``)."""
