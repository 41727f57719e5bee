"""The runtime: the LoopThread bridge, checkpoints and the peer daemon."""
