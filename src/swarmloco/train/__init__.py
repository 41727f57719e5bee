"""Training: tasks (models and data), the inner loop and the DiLoCo driver."""
