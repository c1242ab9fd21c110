"""Talking to XLA: compiling ahead of time on worker threads (`compiling`),
the persistent compilation cache (`compile_cache`), a compiled program's cost
in FLOPs and bytes (`cost`) and its memory against a device's (`memory`, the
pre-flight budget). Below the programs, the loops, callbacks and the Tuner,
which all read these figures; imports nothing of them."""
