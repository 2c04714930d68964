"""Host memory for large, long-lived buffers (no dependency on any other package)."""
