"""Many hosts on one etcd cluster (docs/cluster.md): the client, the key layout, host
membership on a lease, sandbox ownership by compare-and-set, and placement.

Nothing here runs unless ``[cluster] enabled = true``; one host without it is unchanged.
"""
