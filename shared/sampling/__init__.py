"""What a request asks of sampling, torch-free: its parameters, stop strings, structured
output and the logprob records it gets back. The engine applies them (`engine.sampling`)."""
