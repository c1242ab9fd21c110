"""Finding settings before a fit: the Tuner (batch size, learning rate)
and the compiled step's cost (FLOPs, bytes, memory) it reads."""
