"""What leaves a step: the next token chosen from the logits (``sampling``), its text streamed
without split characters (``detokenizer``), and what the engine reports (``observer``)."""
