"""kvgate's C kernels and their build on the machine (``build``)."""
