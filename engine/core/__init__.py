"""The engine's serving loop: scheduler -> runner -> step loop, sequences, the speculator
around them, and the async driver the workers run it under."""
