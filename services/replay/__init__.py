"""The replay service: trajectory storage with on-policy FIFO batches and off-policy sampling."""
