"""What runs inside the node agent (one process per node, never a training rank): the agent
actor, the trace jobs, the trace reader and the summary built from a trace. Never imports
torch or ``worker_ext.rank``."""
