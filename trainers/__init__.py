"""Training-loop hooks and reference trainers."""
