"""The engine: explicit mixed precision for one update (the train step and its seams: policy, loss
scale, micro-step, gradient sources, accumulators, retries), usable without the runner."""
