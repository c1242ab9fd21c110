"""What goes to disk or a bucket: checkpoints (orbax), object storage
(fsspec), exported predict programs."""
