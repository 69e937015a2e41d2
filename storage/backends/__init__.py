"""Where bytes go: fsspec filesystems (local, shared, memory), S3 through s3fs (multipart, conditional
writes, prefix strategies), write sinks and error translation to builtin/our exceptions.

May import: ``smpckpt.errors``. Knows nothing of checkpoints.
"""
