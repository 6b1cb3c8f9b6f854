"""The `specserve` command: the server's commands (``server.cli``) and the training commands (``training.cli``)."""
