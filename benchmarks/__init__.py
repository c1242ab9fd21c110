"""Benchmarks: the Trainer against hand-written loops and PyTorch Lightning."""
