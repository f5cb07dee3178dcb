"""The doing side: turns a SchedulerOutput into tensors, runs the model, samples."""
