"""The Tuner: finding a batch size that fits (``scale_batch_size``) and a
learning rate (``lr_find``) with trial fits. Above the Trainer, which it uses;
only the package's public face and the CLI import it."""
