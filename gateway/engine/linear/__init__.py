"""A step's rows multiplied by a projection's weight so that each row keeps its bits whatever
shares the product: the row padding found on this machine, the products that apply it (kvgate's
panel kernel, oneDNN, BLAS) and the layouts their weights are kept in."""
