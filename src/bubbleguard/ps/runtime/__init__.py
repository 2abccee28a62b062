"""Ray plumbing the strategies build on: cluster, membership (key-value store), the server and
worker actors, the clock service, the recorder, fault injection."""
