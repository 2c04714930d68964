"""Torch-free contracts more than one service uses: config, wire records and proto stubs,
rpc, tokenizer, model-file metadata, block hashes and KV events, sampling parameters,
telemetry setup. Imports nothing of ours but itself."""
