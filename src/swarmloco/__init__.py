"""swarmloco: DiLoCo and Streaming DiLoCo on a swarm of unreliable peers."""

__version__ = "0.1.0"
