"""The scheduler (``scheduler.Scheduler``): asks the modes' strategies for tokens,
rows and blocks, and the block manager for slots, without naming any mode."""
