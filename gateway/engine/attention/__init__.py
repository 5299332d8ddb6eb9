"""The attention backends of the batched forward, one module each (tiled, torch's flash kernel,
the C paged kernel on the CPU, the Triton paged kernel on CUDA), and the choice among them
(``choice``). Each gives a token numbers that depend on its own sequence alone."""
