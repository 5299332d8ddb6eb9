"""Who runs the model. Its sub-packages, top to bottom (each imports only those below it):

- ``engine.py``, ``settings.py``: the public face (``Engine``) and its ``[engine]`` settings;
- ``scheduling/``: who runs in the next step (``scheduler``), the step loop that runs it, the
  requests it holds, their cached blocks and their preemption;
- ``parity/``: the start-up probe that the batched forward is invariant here, the route search
  and its remembered verdicts, shadow verification, the prefill and recompute speeds;
- ``models/``: a checkpoint read into the modules the forward walks (transformers only behind
  ``models/transformers_api.py``);
- ``forward/``: one batched forward over many sequences' new tokens, eager or captured;
- ``attention/``: the attention backends, one module each, chosen in ``attention/choice.py``;
- ``kv/``: a request's KV as a table of pool pages, a step's writes into them, conversation tails;
- ``linear/``: how a step's rows are multiplied by a weight so that each row keeps its bits;
- ``output/``: what leaves a step: the next token, its text, and what the engine reports;
- ``native/``: building and loading the C kernels whose sources sit beside their callers.

The rule is checked by ``tests/architecture/test_layers.py``.
"""
