"""hedgepub.server._iam.iam."""
