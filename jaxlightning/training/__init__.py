"""What runs inside the compiled step: the train state, the step builders,
the optimizer assembled from ``configure_optimizers`` and its traced scale
transformations (plateau, rollback), losses, precision and loss scaling, the
NNX adapter; `contract`, the one reader of a JaxModule's private state.
Nothing here imports the loop, the data path or callbacks."""
