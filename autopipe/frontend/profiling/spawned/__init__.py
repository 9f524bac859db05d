"""Measurements that start processes: two ranks, or a neighbour on the same host.

Modules:
    comm             what crossing between two ranks costs, and the rank runtime's call cost
    comm_fit         comm's measurements fitted: latency + bytes / bandwidth, the call costs
    rank_contention  how much slower a rank computes beside another on the same host
    ports            a rendezvous port out of the ephemeral range ([Note: a rendezvous port])
"""
