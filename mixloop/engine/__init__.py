"""The engine: explicit mixed precision for one update (policy, loss scale, per-layer precision,
loss forms, objectives, EMA, the train step), usable without the runner."""
