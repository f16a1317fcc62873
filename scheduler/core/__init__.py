"""The scheduler and its records: requests as sequence groups, sampling parameters, configs, a step's decisions.

Nothing here knows the model or the device: the scheduler decides which tokens run and keeps
the block manager's tables in step with the sequences; the engine and the runner act on it.
"""
