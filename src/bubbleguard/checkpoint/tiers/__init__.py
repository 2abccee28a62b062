"""Storage tiers for snapshots: shared memory (``shm``) and durable DCP storage (``durable``)."""
