"""Compiling kvgate's C kernels on the machine that runs them, and loading them (``build``).

The kernels' sources sit beside the modules that call them (``attention/native/``,
``linear/native/``); this package, below every other engine layer, only builds and loads."""
