"""What runs inside the compiled step: the train state, the step builders,
optimizers and their transformations, losses, precision and loss scaling,
the NNX adapter. Nothing here imports the loop, the data path or callbacks."""
