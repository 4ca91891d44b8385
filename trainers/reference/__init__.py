"""Reference trainers on real Ray workers: a small model, the policy and rollout workers, and
the SFT / sync / one-step-async / fully-async RL loops. They reach the profiler only through
``trainers.hooks``."""
