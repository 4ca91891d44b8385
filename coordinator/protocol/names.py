"""The names under which the project's actors are found in a Ray cluster."""

from __future__ import annotations

DEFAULT_NAME = "profiler"
"""The coordinator actor's default name."""
DEFAULT_NAMESPACE = "profiler"
"""The coordinator actor's default namespace."""
AGENT_NAMESPACE = "profiler_agents"
"""The namespace of every node agent."""
AGENT_VERSION = "v6"  # v4: trace reports batched; v5: partial v2; v6: plan boards (post_plan)
"""Part of a node agent's name: a cluster still running an agent of an older protocol gets a
new one beside it."""


def agent_name(node_id: str) -> str:
    """The node agent's actor name on the node with this Ray node id."""
    return f"agent-{AGENT_VERSION}-{node_id}"


def is_agent_name(name: str) -> bool:
    """Whether ``name`` is the name of a node agent of this version."""
    return name.startswith(f"agent-{AGENT_VERSION}-")
