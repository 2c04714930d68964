"""From the workers' chunks to what the client reads: text and stop strings, logprobs, usage
and metadata, SSE events and response bodies."""
