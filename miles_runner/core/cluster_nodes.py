"""How a run's Ray nodes are told apart: node k of the plan is the Ray node that offers the custom resource
`miles_node_k`.

Whoever starts Ray for a run gives each node its index: the Ray executor's private Ray (one node: miles_node_0),
the Slurm launcher's job script (`ray start --resources '{"miles_node_K": 1000}'` on the K-th node of the
allocation), and the simulated clusters of the tests (`ray.cluster_utils.Cluster.add_node(resources=...)`).
"""

from __future__ import annotations

NODE_RESOURCE_PREFIX = "miles_node_"
NODE_RESOURCE_UNITS = 1000  # what each node offers; a bundle or actor pinned to a node asks for 1


def node_resource(index: int) -> str:
    """The custom resource that marks plan node `index`."""
    return f"{NODE_RESOURCE_PREFIX}{index}"
