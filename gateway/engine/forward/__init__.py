"""One batched forward over the new tokens of many sequences, each token's numbers its own;
run eagerly or replayed from captured CUDA graphs."""
