"""A step's rows multiplied by a projection's weight so that each row keeps its bits whatever
shares the product: the row padding found on this machine and the products that apply it."""
