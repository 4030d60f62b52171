"""S3-compatible object storage, one module per job: `client` (`S3Client`, the one S3 client, and
the signed requests it makes), `transport` (its large socket reads) and `credentials` (read from a
file or the environment, written for the local parts). Import from the modules themselves.
"""
