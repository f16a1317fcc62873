"""The engine: the step loop over the scheduler and the model runner, beam search on it, and its metrics."""
