"""For operators: the CLI, its tables, notebook frames, plots and collecting a window."""
