"""The multi-turn serving benchmark: workloads, load generation, metrics, a simulator."""
