"""The tenancy library (not a process): what is kept per tenant to share the engine fairly.
Token buckets, virtual-token fairness counters and the drain rate behind Retry-After,
shared by admission, the scheduler and the streamer."""
