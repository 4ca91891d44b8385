"""Each Ray node's name as a merged timeline shows it: its address, with the start of its id
where two nodes share an address (several raylets on one host)."""

from __future__ import annotations

from collections import Counter


def node_names() -> dict[str, str]:
    """Ray node id -> its name; empty when Ray cannot say (no cluster)."""
    try:
        import ray

        nodes = {n["NodeID"]: n.get("NodeManagerAddress") or "" for n in ray.nodes()}
    except Exception:
        return {}
    shared = Counter(nodes.values())
    return {
        node: f"{addr}/{node[:6]}" if not addr or shared[addr] > 1 else addr
        for node, addr in nodes.items()
    }
